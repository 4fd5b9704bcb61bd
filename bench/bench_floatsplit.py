"""floatsplit against plain zstd-3 and ZipNN on the real weights, side by side in one run.

Per real weight file, each tensor as stored (float16, float32) and cast to bfloat16 is saved as
DCP saves it from 1 and from 4 ranks: split into row chunks as FSDP2 shards dim 0 (`torch.chunk`
over the ranks), each chunk one item, the `torch.save` archive of the chunk that DCP's
TORCH_SAVE layout stores. dcpctl's codecs code the items as the checkpoint stores them, framing
and all: plain zstd level 3 (dcpctl's zstd codec) and floatsplit (at its default level and at
its fast level 1, which a save through the FloatSplit extension writes), both directions in 4 MiB
pieces as the pipeline gives them. ZipNN (`ZipNN(input_format="byte", bytearray_dtype=...,
threads=1)`) codes each chunk's raw tensor bytes alone, without the framing. Sizes are stored
bytes over the tensors' raw bytes. The bound is the order-0 entropy of each chunk's exponent plus
its sign and mantissa bits raw, without framing: what order-0 coding of the exponent reaches.
"vs zipnn" is floatsplit's size over ZipNN's, less one. Throughput is raw tensor bytes per CPU
second of the process (all its threads; each contender codes on one), each item's best of
--rounds rounds, contenders taking turns item by item, so other load on the machine matters
less.

With --checkpoint, it also compresses the real-weights DCP checkpoint (bench/real_checkpoint.py;
DCPCTL_BENCH_OUT=DIR reuses a cached one) with `dcpctl compress --codec zstd` and
`--codec floatsplit`, --threads 2, each in a fresh process, and decompresses both results.

Usage: python bench/bench_floatsplit.py [--rounds 3] [--ranks 1 4] [--checkpoint] [--units 11]
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (REPO_ROOT, dcpctl_command, directory_bytes, drop_directory,  # noqa: E402
                     measure, print_table, warm_page_cache)
from real_checkpoint import ENCODER, ONE_GB_UNITS, WHISPER, real_checkpoint  # noqa: E402

sys.path.insert(0, str(REPO_ROOT))
from dcpctl.format.codecs.base import PayloadHint, iter_decoded  # noqa: E402
from dcpctl.format.codecs.registry import (FLOATSPLIT_FAST_LEVEL, floatsplit_codec,  # noqa: E402
                                           zstd_codec)

PIECE_BYTES = 4 << 20
# (exponent bits, sign and mantissa bits) per dtype
FLOAT_BITS = {"bfloat16": (8, 8), "float16": (5, 11), "float32": (8, 24)}


def tensor_items(path: Path, cast_to,
                 ranks: int) -> list[tuple[bytes, PayloadHint, numpy.ndarray]]:
    """Each chunk of each tensor of a safetensors file, as `ranks` FSDP2 ranks save it, as a
    DCP item: (torch.save bytes, hint, raw words)."""
    import torch
    from safetensors import safe_open

    items = []
    with safe_open(path, "pt") as weights:
        for name in weights.keys():
            tensor = weights.get_tensor(name)
            tensor = tensor.to(cast_to) if cast_to is not None else tensor
            for chunk in torch.chunk(tensor.reshape(tensor.shape or (1,)), ranks):
                chunk = chunk.clone()  # DCP saves a chunk with a storage of its own
                archive = io.BytesIO()
                torch.save(chunk, archive)
                dtype_name = str(chunk.dtype).removeprefix("torch.")
                words = chunk.reshape(-1).view(torch.int16 if chunk.element_size() == 2
                                               else torch.int32).numpy()
                items.append((archive.getvalue(),
                              PayloadHint.of_contiguous(dtype_name, chunk.element_size(),
                                                        chunk.shape), words))
    return items


def entropy_bound_bytes(items) -> float:
    """Order-0 entropy of each chunk's exponent, raw sign and mantissa bits."""
    total_bits = 0.0
    for _, hint, words in items:
        exponent_bits, other_bits = FLOAT_BITS[hint.dtype_name]
        mantissa_bits = other_bits - 1
        exponents = (words.view(numpy.uint16 if words.itemsize == 2 else numpy.uint32)
                     >> mantissa_bits) & ((1 << exponent_bits) - 1)
        counts = numpy.bincount(exponents.astype(numpy.int64))
        probabilities = counts[counts > 0] / max(len(exponents), 1)
        total_bits += len(exponents) * (other_bits - (probabilities * numpy.log2(probabilities))
                                        .sum())
    return total_bits / 8


def dcpctl_coder(codec):
    """(encode, decode) of one item with a dcpctl codec, piece by piece like the pipeline."""
    def encode(item: bytes, hint: PayloadHint) -> list[bytes]:
        encoder = codec.new_encoder(len(item), hint)
        pieces = [encoder.encode(item[start:start + PIECE_BYTES])
                  for start in range(0, len(item), PIECE_BYTES)]
        return pieces + [encoder.finish()]

    def decode(pieces: list[bytes]) -> list[bytes]:
        return list(iter_decoded(codec.new_decoder(), pieces))

    return encode, decode


def zipnn_coder():
    """(encode, decode) of one item with ZipNN on one thread."""
    from zipnn import ZipNN

    coders = {}

    def coder(dtype_name: str):
        if dtype_name not in coders:
            coders[dtype_name] = ZipNN(input_format="byte", bytearray_dtype=dtype_name, threads=1)
        return coders[dtype_name]

    def encode(raw: bytearray, hint: PayloadHint):
        return hint.dtype_name, coder(hint.dtype_name).compress(raw)

    def decode(encoded) -> list[bytes]:
        dtype_name, data = encoded
        return [coder(dtype_name).decompress(data)]

    return encode, decode


def run_contenders(items, rounds: int) -> dict[str, tuple[int, float, float]]:
    """Stored bytes and CPU seconds to encode and decode, per contender; checks round trips.
    Contenders take turns item by item, and each item's time is its best of `rounds`, so a
    burst of load on the machine hits them alike."""
    contenders = {"zstd-3": dcpctl_coder(zstd_codec(3)), "zipnn": zipnn_coder(),
                  "floatsplit": dcpctl_coder(floatsplit_codec()),
                  "floatsplit-1": dcpctl_coder(floatsplit_codec(FLOATSPLIT_FAST_LEVEL))}
    sizes = dict.fromkeys(contenders, 0)
    best = {(name, index, step): float("inf") for name in contenders
            for index in range(len(items)) for step in ("encode", "decode")}
    for round_index in range(rounds):
        for index, (item, hint, words) in enumerate(items):
            raw = words.tobytes()
            for name, (encode, decode) in contenders.items():
                # ZipNN codes the raw bytes, and rewrites its input in place: it gets a copy
                given, expected = (bytearray(raw), raw) if name == "zipnn" else (item, item)
                started = time.process_time()
                encoded = encode(given, hint)
                encoded_at = time.process_time()
                decoded = decode(encoded)
                decoded_at = time.process_time()
                best[name, index, "encode"] = min(best[name, index, "encode"],
                                                  encoded_at - started)
                best[name, index, "decode"] = min(best[name, index, "decode"],
                                                  decoded_at - encoded_at)
                if b"".join(decoded) != expected:
                    raise AssertionError(f"{name} does not round-trip item {index}")
                if round_index == 0:
                    sizes[name] += len(encoded[1]) if name == "zipnn" else sum(map(len, encoded))
    return {name: (sizes[name],
                   sum(best[name, index, "encode"] for index in range(len(items))),
                   sum(best[name, index, "decode"] for index in range(len(items))))
            for name in contenders}


def compare_items(rounds: int, rank_counts: list[int]) -> None:
    """The per-file, per-dtype, per-rank-count table."""
    import torch

    rows = []
    for path in (WHISPER, ENCODER):
        for cast_to in (None, torch.bfloat16):
            for ranks in rank_counts:
                items = tensor_items(path, cast_to, ranks)
                raw_bytes = sum(words.nbytes for _, _, words in items)
                bound = entropy_bound_bytes(items)
                results = run_contenders(items, rounds)
                sizes = {name: size / raw_bytes for name, (size, _, _) in results.items()}
                speeds = [f"{raw_bytes / seconds / 1e6:.0f}" for _, encode, decode
                          in results.values() for seconds in (encode, decode)]
                rows.append((path.stem, items[0][1].dtype_name, ranks, len(items),
                             f"{raw_bytes / 1e6:.1f}",
                             *(f"{ratio:.4f}" for ratio in sizes.values()),
                             f"{bound / raw_bytes:.4f}",
                             f"{sizes['floatsplit'] / sizes['zipnn'] - 1:+.2%}", *speeds))
    print_table(rows, ("file", "dtype", "ranks", "items", "MB", "zstd-3", "zipnn", "floatsplit",
                       "fs-1", "bound", "vs zipnn", "zstd c", "zstd d", "zipnn c", "zipnn d",
                       "fs c", "fs d", "fs-1 c", "fs-1 d"))
    print("sizes: stored bytes over raw tensor bytes (zstd-3 and floatsplit with each item's "
          "framing, zipnn without); floatsplit at its default level, fs-1 at its fast level 1 "
          "(a save's default); c, d: MB/s per thread (CPU time) to compress, decompress")


def compare_checkpoint(units: int) -> None:
    """`dcpctl compress --codec zstd` and `--codec floatsplit` on the real-weights checkpoint."""
    source = real_checkpoint(units, 4)
    source_bytes = directory_bytes(source)
    out_root = REPO_ROOT / "bench" / "out"
    rows = []
    for codec in ("zstd", "floatsplit"):
        compressed, plain = out_root / f"floatsplit-bench-{codec}", out_root / "floatsplit-plain"
        drop_directory(compressed)
        drop_directory(plain)
        warm_page_cache(source)
        packing = measure(codec, dcpctl_command("compress", str(source), "-o", str(compressed),
                                                "--codec", codec, "--threads", "2"))
        unpacking = measure(codec, dcpctl_command("decompress", str(compressed), "-o",
                                                  str(plain), "--threads", "2"))
        stored = directory_bytes(compressed)
        rows.append((codec, f"{stored / 1e6:.1f}", f"{stored / source_bytes:.4f}",
                     f"{packing.seconds:.1f}", f"{packing.peak_rss_bytes / 2**20:.0f}",
                     f"{unpacking.seconds:.1f}"))
        drop_directory(compressed)
        drop_directory(plain)
    print(f"\ncheckpoint {source} ({source_bytes / 1e9:.2f} GB), --threads 2")
    print_table(rows, ("codec", "output MB", "out/in", "compress s", "peak RSS MiB",
                       "decompress s"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--checkpoint", action="store_true")
    parser.add_argument("--units", type=int, default=ONE_GB_UNITS)
    args = parser.parse_args()
    compare_items(args.rounds, args.ranks)
    if args.checkpoint:
        compare_checkpoint(args.units)


if __name__ == "__main__":
    main()
