"""A checkpoint saved with `use_collectives=False`: no `.metadata`, but each rank's own.

torch's `dcp.save(..., use_collectives=False)` (and `no_dist=True` with it, one process) plans
and writes each rank alone: rank r writes its data files `__<r>_<n>.distcp` and then
`__<r>.metadata`, DCP metadata of its own items only (a sharded tensor's entry gives its full
size and the chunks of that rank), and no `.metadata`. `dcp.load` reads it back rank by rank,
each rank its own file, so only the world size that saved it can load it.

dcpctl reads it as one checkpoint: the ranks' metadata merged (merged_rank_metadata). Each
tensor's chunks are those of every rank; a chunk several ranks saved whole (a replicated
tensor: nothing told the ranks apart) is taken once, from the lowest rank, as is an object
several saved (torch's own deduplication of a collective save keeps one copy as well), and
as is a tensor each rank saved whole with a dtype or size of its own (a per-rank buffer). The
other ranks' copies are its replicas: verify and checksum check their bytes too, as each rank
loads its own, and the structure checks look at them, but nothing reads them to move data
(deep verify names those that hold other values than the kept copy).
Each rank's metadata must hold together on its own first (every chunk and object with its
storage entry, every entry with one of them), as torch loads each rank from it alone.
Commands that write a new checkpoint (reshard, convert) write it with one `.metadata`, which
any world size loads; compress and decompress, which keep a checkpoint's layout, refuse it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from dcpctl.errors import MetadataError
from dcpctl.format.file_names import rank_of_file_name, rank_of_metadata_file_name
from dcpctl.format.metadata.reading import read_metadata
from dcpctl.format.metadata.records import (CheckpointMetadata, ChunkMetadata, MetadataIndex,
                                            StorageInfo, TensorMetadata)
from dcpctl.storage.paths import StoragePath
from dcpctl.wording import counted


@dataclass(slots=True)
class Replica:
    """A rank's copy of an item a lower rank saved as well: its key, its chunk (None for an
    object) and where its bytes are."""

    key: MetadataIndex
    chunk: ChunkMetadata | None
    storage: StorageInfo
    tensor: TensorMetadata | None = None
    """The rank's own entry of a tensor it saved whole with another dtype or size than the
    copy kept (a per-rank buffer); None where it is the kept copy's."""


ItemKey = tuple[str, tuple[int, ...] | None]
"""An item's fqn and its chunk's offsets (None for an object): what its copies share."""


def item_key(key: MetadataIndex) -> ItemKey:
    """The ItemKey of a storage entry's key."""
    return key.fqn, None if key.offset is None else tuple(key.offset)


def replicated_keys(replicas: Iterable[Replica]) -> set[ItemKey]:
    """The items several ranks saved: those the replicas are copies of."""
    return {item_key(replica.key) for replica in replicas}


def rank_metadata_names(names: Iterable[str]) -> list[str]:
    """The ranks' own metadata files among the names in a checkpoint directory, by rank."""
    ranked = ((rank_of_metadata_file_name(name), name) for name in names)
    return [name for _, name in sorted(
        (rank, name) for rank, name in ranked if rank is not None)]


def first_rank_lacking_metadata(names: Iterable[str], rank_files: list[str]) -> int | None:
    """The lowest rank of a save with use_collectives=False (whose own metadata files of the
    names in its directory are rank_files) that has not written its metadata, of those with
    data files and those below the highest rank that has (every rank writes its own); None
    where none has not. A save still running, or one that died; the ranks above the highest
    that wrote anything no name tells. Linear in the names, whatever ranks they give."""
    have = sorted({rank_of_metadata_file_name(name) for name in rank_files})
    below_highest = next((rank for rank, held in enumerate(have) if held != rank), None)
    with_data = {rank_of_file_name(name) for name in names if "/" not in name} - {None}
    lacking = list(with_data - set(have))
    if below_highest is not None:
        lacking.append(below_highest)
    return min(lacking, default=None)


def left_by_a_larger_save(lacking: int, rank_files: list[str]) -> str | None:
    """Where the lowest rank lacking metadata (first_rank_lacking_metadata) is above every
    rank that wrote its own, what else its files may be than a save cut short: an earlier
    save's into this directory with more ranks, whose files torch's writers leave behind (the
    ranks that wrote metadata make a checkpoint of their own, which torch loads)."""
    ranks = len(rank_files)
    if lacking < ranks:
        return None
    return (f"or files left by an earlier save into this directory with more ranks, beside a "
            f"whole save of {counted(ranks, 'rank')}, which torch loads at that world size")


def describe_rank_metadata(rank_files: list[str]) -> str:
    """Who wrote a checkpoint read from these ranks' own metadata files, in words."""
    return f"torch dcp.save with use_collectives=False, {counted(len(rank_files), 'rank')}"


def merged_rank_metadata(directory: StoragePath, names: list[str]
                         ) -> tuple[CheckpointMetadata, list[Replica]]:
    """The metadata of a checkpoint saved with use_collectives=False, from its ranks' own
    files (rank_metadata_names, lowest rank first), and the replicas that merging set aside.
    Each rank's metadata is looked at once, each of its chunks once: linear in all of them."""
    merger = None
    for name in names:
        rank = read_metadata(directory, name)
        _refuse_unjoined_entries(rank, str(directory / name))
        _refuse_other_ranks_files(rank, rank_of_metadata_file_name(name), str(directory / name))
        if merger is None:
            merger = _Merger(rank)
        else:
            merger.add(rank, str(directory / name))
    return merger.merged, merger.replicas


def _refuse_unjoined_entries(rank: CheckpointMetadata, source: str) -> None:
    """Refuse a rank's metadata where a chunk or object lacks a storage entry, or an entry
    names none of them: torch loads each rank from its own metadata alone, and such a rank
    loads a tensor left unset, or fails; merged with the others', its entry could pass for
    another rank's."""
    entries = {(fqn, tuple(chunk.offsets)) for fqn, entry in rank.state_dict_metadata.items()
               if isinstance(entry, TensorMetadata) for chunk in entry.chunks}
    entries.update((fqn, None) for fqn, entry in rank.state_dict_metadata.items()
                   if not isinstance(entry, TensorMetadata))
    stored = {item_key(key) for key in rank.storage_data}
    lacking = entries - stored
    if lacking:
        raise MetadataError(f"gives {_item(*min(lacking, key=str))} no storage entry",
                            path=source)
    orphans = stored - entries
    if orphans:
        raise MetadataError(f"has a storage entry for {_item(*min(orphans, key=str))}, which it "
                            "does not hold", path=source)


def _refuse_other_ranks_files(rank: CheckpointMetadata, number: int, source: str) -> None:
    """Refuse a rank's metadata that places an item in a file not of that rank: torch's writer
    (use_collectives=False) names each rank's files `__<rank>_<n>.distcp`; merged, such an
    entry reads another rank's bytes as this rank's."""
    paths = {info.relative_path for info in rank.storage_data.values()}  # a file or a few
    if all(rank_of_file_name(path) == number for path in paths):
        return
    for key, info in rank.storage_data.items():
        if rank_of_file_name(info.relative_path) != number:
            raise MetadataError(
                f"places {_item(*item_key(key))} in {info.relative_path!r}, not a file of rank "
                f"{number}: torch's writer puts each rank's items in its own files "
                f"(__{number}_<n>.distcp)", path=source)


def _item(fqn: str, offsets: tuple[int, ...] | None) -> str:
    return f"object {fqn!r}" if offsets is None else f"the chunk of {fqn!r} at {list(offsets)}"


@dataclass
class _Merger:
    """The ranks' metadata merged so far (lowest rank first), and its replicas."""

    merged: CheckpointMetadata
    replicas: list[Replica] = field(default_factory=list)
    chunk_keys: dict[str, set[tuple]] = field(default_factory=dict)
    """(offsets, sizes) of the chunks of each tensor two ranks saved so far."""

    def add(self, rank: CheckpointMetadata, source: str) -> None:
        """Add a rank's metadata: new entries and chunks join the merged metadata, the items
        a lower rank saved too are set aside as replicas."""
        entries = self.merged.state_dict_metadata
        shared_chunks: dict[tuple[str, tuple[int, ...]], ChunkMetadata] = {}
        own_entries: dict[str, TensorMetadata] = {}
        for fqn, entry in rank.state_dict_metadata.items():
            known = entries.get(fqn)
            if known is None:
                entries[fqn] = entry
                continue
            if isinstance(entry, TensorMetadata) != isinstance(known, TensorMetadata):
                raise MetadataError(f"holds {fqn!r} as {_kind(entry)} where a lower rank's "
                                    f"metadata holds {_kind(known)}", path=source)
            if isinstance(entry, TensorMetadata) and _disagree(entry, known):
                if not (_whole(entry) and _whole(known)):  # a sharded tensor of two sizes
                    raise MetadataError(
                        f"gives tensor {fqn!r} dtype {entry.properties.dtype.name} and size "
                        f"{list(entry.size)} where a lower rank's metadata gives "
                        f"{known.properties.dtype.name} and {list(known.size)}", path=source)
                # a tensor each rank saved whole as its own (a per-rank buffer): the kept
                # copy stays, this rank's is a replica of its own dtype and size
                shared_chunks[(fqn, tuple(entry.chunks[0].offsets))] = entry.chunks[0]
                own_entries[fqn] = entry
            elif isinstance(entry, TensorMetadata):
                keys = self.chunk_keys.get(fqn)
                if keys is None:
                    keys = self.chunk_keys[fqn] = {
                        (tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in known.chunks}
                for chunk in entry.chunks:
                    offsets = tuple(chunk.offsets)
                    shared_chunks[(fqn, offsets)] = chunk
                    if (offsets, tuple(chunk.sizes)) not in keys:
                        keys.add((offsets, tuple(chunk.sizes)))
                        known.chunks.append(chunk)  # its own; one overlapping is damage
        storage_data = self.merged.storage_data
        for key, info in rank.storage_data.items():
            if key in storage_data:
                chunk = None if key.offset is None else shared_chunks.get(
                    (key.fqn, tuple(key.offset)))
                self.replicas.append(Replica(key, chunk, info, own_entries.get(key.fqn)))
            else:
                storage_data[key] = info
        for name in ("planner_data", "mcore_data"):  # fqns' own data: the lowest rank's
            mine, theirs = getattr(self.merged, name), getattr(rank, name)
            if isinstance(mine, dict) and isinstance(theirs, dict):
                for fqn, value in theirs.items():
                    mine.setdefault(fqn, value)


def _disagree(entry: TensorMetadata, known: TensorMetadata) -> bool:
    return (entry.properties.dtype, tuple(entry.size)) != (known.properties.dtype,
                                                           tuple(known.size))


def _whole(entry: TensorMetadata) -> bool:
    """Whether the entry is a tensor saved whole, in one chunk (not one rank's shard)."""
    return len(entry.chunks) == 1 and not any(entry.chunks[0].offsets) and tuple(
        entry.chunks[0].sizes) == tuple(entry.size)


def _kind(entry: object) -> str:
    return "a tensor" if isinstance(entry, TensorMetadata) else "an object"
