"""Checking an item as its decoded bytes go by, the one check every command makes of what it
reads: the torch.save archive the bytes form is whole (every record matches its CRC-32), and a
tensor item holds the dtype and shape of its chunk. A non-tensor item is an archive too:
torch's save planner torch.saves every one (an `io.BytesIO` as well), and its load planner
torch.loads every one.

Memory stays at two windows of the archive, each held in whole pieces as read (at most a piece
more; torch_save/archive_check.py); the rare archive whose records lie outside them is read
again, through `reread`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

from dcpctl.errors import DataError, DcpctlError
from dcpctl.format.checkpoint.locations import ItemLocation
from dcpctl.format.checkpoint.problems import Problem, Rule, problems_error
from dcpctl.format.torch_save.archive_check import (ArchiveCheck, ArchiveStreamCheck,
                                                    spooled_read_range)
from dcpctl.format.torch_save.zip_records import LOCAL_SIGNATURE, ReadRange
from dcpctl.storage.objects import StorageError
from dcpctl.storage.paths import open_ranged

Reread = Callable[[], Iterable[bytes]]
"""The item's decoded bytes once more, from the start."""


class NotAnArchiveError(DataError):
    """An item's first decoded bytes are no torch.save archive's: raised at once, so that a
    stored item that decodes to gigabytes of something else stops there."""

    def __init__(self, problem: Problem, path) -> None:
        super().__init__(problems_error([problem], path).message, path=path,
                         fqn=problem.fqns[0], start=problem.start, end=problem.end)
        self.problem = problem


_SERIALIZATION_ID = ".data/serialization_id"
"""The record torch.save writes a new random id into each time."""


class ItemCheck:
    """Fed an item's decoded bytes in order, finds what is wrong with them (see the module)."""

    def __init__(self, location: ItemLocation) -> None:
        self.location = location
        self._archive = ArchiveStreamCheck()
        self._start_checked = location.raw  # a tensor's bare bytes have no archive to start
        self.checked: ArchiveCheck | None = None
        """The archive as checked, once problems() found it one."""

    def feed(self, piece: bytes) -> None:
        """Take the next decoded piece; raises NotAnArchiveError as soon as the item's first
        bytes are no zip record's, as every torch.save archive starts."""
        self._archive.update(piece)
        if not self._start_checked and self._archive.length_bytes >= len(LOCAL_SIGNATURE):
            self._start_checked = True
            if not self._archive.starts_with(LOCAL_SIGNATURE):
                raise NotAnArchiveError(self._problem(
                    Rule.ARCHIVE, "item is not a torch.save archive: its bytes do not start "
                    "with a zip record"), self.location.path)

    def problems(self, reread: Reread) -> list[Problem]:
        """What is wrong with the item fed, as problems without a file name (the item's own
        byte range and fqn)."""
        location = self.location
        if location.raw:  # a tensor's bare bytes (SAFETENSORS): only their count to check
            if self._archive.length_bytes != location.expected.nbytes:
                return [self._problem(Rule.STORED_LENGTH, f"holds {self._archive.length_bytes} "
                                      f"bytes; the chunk has {location.expected.nbytes}")]
            return []
        try:
            checked = self.checked = self._archive.finish(
                location.expected is not None, lambda: _random_access(location, reread))
        except StorageError:  # the store failed, not the item
            raise
        except DcpctlError as error:
            return [self._problem(Rule.ARCHIVE, "item is not an intact torch.save archive: "
                                  f"{error.message}")]
        return self._archive_problems(checked)

    def content_crcs(self) -> tuple[tuple[str, int], ...] | None:
        """What the item holds, told by its records' CRC-32s (the names below the archive's
        own, but the id each torch.save draws anew): two items that hold the same tensor or
        the same pickle give the same. None where it is no intact archive whose CRC-32s were
        recorded and hold."""
        checked = self.checked
        if checked is None or not checked.crc_recorded or checked.crc_mismatches:
            return None
        return tuple(sorted((name, record.crc32) for record in checked.records
                            if (name := record.name.partition("/")[2]) != _SERIALIZATION_ID))

    def raise_problems(self, reread: Reread) -> None:
        """Raise the first problem as a DataError naming the file, item and byte range."""
        problems = self.problems(reread)
        if problems:
            raise problems_error(problems[:1], self.location.path)

    def _problem(self, rule: str, message: str, start: int | None = None,
                 end: int | None = None) -> Problem:
        location = self.location
        return Problem(rule, message, None, location.start if start is None else start,
                       location.end if end is None else end, (location.fqn,))

    def _archive_problems(self, checked: ArchiveCheck) -> list[Problem]:
        location, expected = self.location, self.location.expected
        plain = not location.codec.descriptors
        problems = []
        for record, actual_crc in checked.crc_mismatches:
            where = ((location.start + record.data_offset, location.start + record.data_end)
                     if plain else (None, None))
            problems.append(self._problem(
                Rule.CRC_MISMATCH, f"record {record.name!r} (bytes {record.data_offset}.."
                f"{record.data_end} of the {'' if plain else 'decoded '}item) has CRC-32 "
                f"{actual_crc:08x}, its archive says {record.crc32:08x}", *where))
        if checked.layout_error is not None:
            problems.append(self._problem(Rule.ARCHIVE, "tensor item is not a torch.save "
                                          f"archive of one tensor: {checked.layout_error}"))
        if checked.layout is None or expected is None:
            return problems
        saved, storage = checked.layout.tensor, checked.layout.storage
        if saved.dtype != expected.dtype or saved.shape != expected.sizes:
            problems.append(self._problem(
                Rule.TENSOR_MISMATCH, f"item holds a {saved.dtype.name} tensor of shape "
                f"{list(saved.shape)}; the metadata says {expected.dtype.name} "
                f"{list(expected.sizes)}"))
        elif storage.size_bytes != expected.nbytes:
            problems.append(self._problem(
                Rule.STORED_LENGTH, f"storage record {storage.name!r} holds {storage.size_bytes} "
                f"bytes; the chunk has {expected.nbytes}"))
        return problems


@contextlib.contextmanager
def _random_access(location: ItemLocation, reread: Reread) -> Iterator[ReadRange]:
    """Random reads of the decoded item: straight from its file when stored plainly, else
    decoded once more into a temporary file."""
    if not location.codec.descriptors:
        with open_item_file(location) as read_at:
            yield lambda start, count: read_at(location.start + start, count)
        return
    with spooled_read_range(reread()) as read_range:
        yield read_range


@contextlib.contextmanager
def open_item_file(location: ItemLocation) -> Iterator[ReadRange]:
    """Ranged reads of the item's file, open for the block."""
    with open_ranged(location.path) as reader:
        yield reader.read
