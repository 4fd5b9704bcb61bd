"""floatsplit against plain zstd-3 and ZipNN on the real weights, side by side in one run.

Per real weight file, each tensor as stored (float16, float32) and cast to bfloat16 becomes a
DCP item (its `torch.save` archive, as DCP's TORCH_SAVE layout stores it), and every contender
codes the same items: plain zstd level 3 (dcpctl's zstd codec), ZipNN
(`ZipNN(input_format="byte", bytearray_dtype=..., threads=1)`; given a copy of each item, as it
rewrites its input in place) and floatsplit, both directions in 4 MiB pieces as the pipeline
gives them. Sizes are stored bytes over item bytes. The bound is the order-0 entropy of each
tensor's exponent plus its sign and mantissa bits raw, plus each item's framing coded with
zstd-3. Throughput is item bytes per CPU second of the process (all its threads; each contender
codes on one), each item's best of --rounds rounds, contenders taking turns item by item, so
other load on the machine matters less.

With --checkpoint, it also compresses the real-weights DCP checkpoint (bench/real_checkpoint.py;
DCPCTL_BENCH_OUT=DIR reuses a cached one) with `dcpctl compress --codec zstd` and
`--codec floatsplit`, --threads 2, each in a fresh process, and decompresses both results.

Usage: python bench/bench_floatsplit.py [--rounds 3] [--checkpoint] [--units 11]
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
from dcpctl.format.codecs.registry import floatsplit_codec  # noqa: E402
from dcpctl.format.codecs.registry import zstd_codec
from dcpctl.format.torch_save.layout import find_payload_start  # noqa: E402

PIECE_BYTES = 4 << 20
# (exponent bits, sign and mantissa bits) per dtype
FLOAT_BITS = {"bfloat16": (8, 8), "float16": (5, 11), "float32": (8, 24)}


def tensor_items(path: Path, cast_to) -> list[tuple[bytes, PayloadHint, numpy.ndarray]]:
    """Each tensor of a safetensors file as a DCP item: (torch.save bytes, hint, raw words)."""
    import torch
    from safetensors import safe_open

    items = []
    with safe_open(path, "pt") as weights:
        for name in weights.keys():
            tensor = weights.get_tensor(name)
            tensor = tensor.to(cast_to) if cast_to is not None else tensor
            archive = io.BytesIO()
            torch.save(tensor, archive)
            dtype_name = str(tensor.dtype).removeprefix("torch.")
            words = tensor.reshape(-1).view(torch.int16 if tensor.element_size() == 2
                                            else torch.int32).numpy()
            items.append((archive.getvalue(),
                          PayloadHint(dtype_name, tensor.numel() * tensor.element_size()), words))
    return items


def entropy_bound_bytes(items, level: int = 3) -> float:
    """Order-0 entropy of each tensor's exponent, raw sign and mantissa bits, zstd'd framing."""
    import zstandard

    compressor = zstandard.ZstdCompressor(level=level)
    total_bits = 0.0
    for item, hint, words in items:
        exponent_bits, other_bits = FLOAT_BITS[hint.dtype_name]
        mantissa_bits = other_bits - 1
        exponents = (words.view(numpy.uint16 if words.itemsize == 2 else numpy.uint32)
                     >> mantissa_bits) & ((1 << exponent_bits) - 1)
        counts = numpy.bincount(exponents.astype(numpy.int64))
        probabilities = counts[counts > 0] / max(len(exponents), 1)
        total_bits += len(exponents) * (other_bits - (probabilities * numpy.log2(probabilities))
                                        .sum())
        start = find_payload_start(item[:1 << 16])
        head, tail = item[:start], item[start + hint.payload_bytes:]
        total_bits += 8 * (len(compressor.compress(head)) + len(compressor.compress(tail)))
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

    def encode(item: bytearray, hint: PayloadHint):
        return hint.dtype_name, coder(hint.dtype_name).compress(item)

    def decode(encoded) -> list[bytes]:
        dtype_name, data = encoded
        return [coder(dtype_name).decompress(data)]

    return encode, decode


def run_contenders(items, rounds: int) -> dict[str, tuple[int, float, float]]:
    """Stored bytes and CPU seconds to encode and decode, per contender; checks round trips.
    Contenders take turns item by item, and each item's time is its best of `rounds`, so a
    burst of load on the machine hits them alike."""
    contenders = {"zstd-3": dcpctl_coder(zstd_codec(3)), "zipnn": zipnn_coder(),
                  "floatsplit": dcpctl_coder(floatsplit_codec())}
    sizes = dict.fromkeys(contenders, 0)
    best = {(name, index, step): float("inf") for name in contenders
            for index in range(len(items)) for step in ("encode", "decode")}
    for round_index in range(rounds):
        for index, (item, hint, _) in enumerate(items):
            for name, (encode, decode) in contenders.items():
                given = bytearray(item) if name == "zipnn" else item
                started = time.process_time()
                encoded = encode(given, hint)
                encoded_at = time.process_time()
                decoded = decode(encoded)
                decoded_at = time.process_time()
                best[name, index, "encode"] = min(best[name, index, "encode"],
                                                  encoded_at - started)
                best[name, index, "decode"] = min(best[name, index, "decode"],
                                                  decoded_at - encoded_at)
                if b"".join(decoded) != item:
                    raise AssertionError(f"{name} does not round-trip item {index}")
                if round_index == 0:
                    sizes[name] += len(encoded[1]) if name == "zipnn" else sum(map(len, encoded))
    return {name: (sizes[name],
                   sum(best[name, index, "encode"] for index in range(len(items))),
                   sum(best[name, index, "decode"] for index in range(len(items))))
            for name in contenders}


def compare_items(rounds: int) -> None:
    """The per-file, per-dtype table."""
    import torch

    rows = []
    for path in (WHISPER, ENCODER):
        for cast_to in (None, torch.bfloat16):
            items = tensor_items(path, cast_to)
            item_bytes = sum(len(item) for item, _, _ in items)
            bound = entropy_bound_bytes(items)
            results = run_contenders(items, rounds)
            sizes = {name: size / item_bytes for name, (size, _, _) in results.items()}
            speeds = [f"{item_bytes / seconds / 1e6:.0f}"
                      for _, encode, decode in results.values() for seconds in (encode, decode)]
            rows.append((path.stem, items[0][1].dtype_name, f"{item_bytes / 1e6:.1f}",
                         *(f"{ratio:.4f}" for ratio in sizes.values()),
                         f"{bound / item_bytes:.4f}",
                         f"{results['floatsplit'][0] / bound:.4f}", *speeds))
    print_table(rows, ("file", "dtype", "MB", "zstd-3", "zipnn", "floatsplit", "bound",
                       "fs/bound", "zstd c", "zstd d", "zipnn c", "zipnn d", "fs c", "fs d"))
    print("sizes: stored/item bytes; c, d: MB/s per thread (CPU time) to compress, decompress")


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
    parser.add_argument("--checkpoint", action="store_true")
    parser.add_argument("--units", type=int, default=ONE_GB_UNITS)
    args = parser.parse_args()
    compare_items(args.rounds)
    if args.checkpoint:
        compare_checkpoint(args.units)


if __name__ == "__main__":
    main()
