"""convert: dcpctl against torch's way, on the real-weights checkpoint, side by side.

torch's way to safetensors: `dcp_to_torch_save(CKPT, state.pt)` (the whole checkpoint loaded
into memory and saved), then `torch.load(state.pt)` and `safetensors.torch.save_file` of the
same tensors dcpctl writes. dcpctl: `dcpctl convert CKPT --to safetensors -o OUT`, with its
default selection (the `model.*` weights, `model.` stripped), with every tensor, with one
unit's weights only (a twelfth of the data: peak memory should not change) and with one 4-byte
tensor (dcpctl's fixed cost: interpreter, modules, the checkpoint's metadata). Also
`dcp_to_torch_save` alone against `dcpctl convert --to torch`. Each runs in a fresh process
under /usr/bin/time -v (wall time, peak RSS) with the input in the page cache; `python -c
"import torch"` gives the fixed cost of a process that imports torch. The outputs of both ways
are compared tensor by tensor.

Usage: python bench/bench_convert.py [--units 11] [--threads 2]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import (dcpctl_command, directory_bytes, measure, print_table,  # noqa: E402
                     python_command, warm_page_cache)
from real_checkpoint import ONE_GB_UNITS, real_checkpoint  # noqa: E402

TORCH_TO_SAFETENSORS = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
source, staging, target, everything = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
dcp_to_torch_save(source, staging)
state = torch.load(staging, weights_only=True)
if everything:
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
else:
    tensors = {k.removeprefix("model."): v for k, v in state.items()
               if k.startswith("model.") and isinstance(v, torch.Tensor)}
save_file(tensors, target, metadata={"format": "pt"})
"""
TORCH_SAVE = """
import sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""
SAME_TENSORS = """
import sys, torch
from safetensors import safe_open
with safe_open(sys.argv[1], "pt") as mine, safe_open(sys.argv[2], "pt") as theirs:
    assert set(mine.keys()) == set(theirs.keys()), "different tensor names"
    for name in mine.keys():
        assert torch.equal(mine.get_tensor(name), theirs.get_tensor(name)), name
"""


def _largest_tensor_bytes(checkpoint: Path) -> int:
    from dcpctl.format.checkpoint.view import open_checkpoint

    return max(tensor.nbytes for tensor in open_checkpoint(checkpoint).tensors)


def _runs(source: Path, scratch: Path, threads: str) -> list[tuple[str, str, list[str]]]:
    to_safetensors = ["convert", str(source), "--to", "safetensors", "--threads", threads]
    return [
        ("python -c 'import torch' (fixed cost)", "import", python_command("import torch")),
        ("torch: dcp_to_torch_save + save_file (model.*)", "torch-model",
         python_command(TORCH_TO_SAFETENSORS) + [str(source), str(scratch / "a.pt"),
                                                 str(scratch / "torch-model.safetensors"), "0"]),
        ("dcpctl convert --to safetensors (model.*)", "dcpctl-model",
         dcpctl_command(*to_safetensors, "-o", str(scratch / "dcpctl-model"))),
        ("dcpctl convert --to safetensors (model.unit0.* only)", "dcpctl-unit",
         dcpctl_command(*to_safetensors, "-o", str(scratch / "dcpctl-unit"), "--include",
                        "model.unit0.*")),
        ("dcpctl convert --to safetensors (one 4-byte tensor)", "dcpctl-fixed",
         dcpctl_command(*to_safetensors, "-o", str(scratch / "dcpctl-fixed"), "--include",
                        "model.unit0.encoder.similarity_bias")),
        ("torch: dcp_to_torch_save + save_file (all)", "torch-all",
         python_command(TORCH_TO_SAFETENSORS) + [str(source), str(scratch / "b.pt"),
                                                 str(scratch / "torch-all.safetensors"), "1"]),
        ("dcpctl convert --to safetensors --include '*' (all)", "dcpctl-all",
         dcpctl_command(*to_safetensors, "-o", str(scratch / "dcpctl-all"), "--include", "*",
                        "--strip-prefix", "")),
        ("torch: dcp_to_torch_save", "torch-save",
         python_command(TORCH_SAVE) + [str(source), str(scratch / "torch-save.pt")]),
        ("dcpctl convert --to torch", "dcpctl-torch",
         dcpctl_command("convert", str(source), "--to", "torch", "--threads", threads,
                        "-o", str(scratch / "dcpctl-torch.pt"))),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=ONE_GB_UNITS)
    parser.add_argument("--threads", default="2")
    args = parser.parse_args()
    source = real_checkpoint(args.units, 4)
    source_bytes = directory_bytes(source)
    largest = _largest_tensor_bytes(source)
    scratch = Path(tempfile.mkdtemp(prefix="dcpctl-bench-convert-"))
    try:
        results = {}
        for label, name, command in _runs(source, scratch, args.threads):
            warm_page_cache(source)
            results[name] = (label, measure(label, command))
            for intermediate in (scratch / "a.pt", scratch / "b.pt"):
                intermediate.unlink(missing_ok=True)
        for kind in ("model", "all"):
            checked = measure("compare", python_command(SAME_TENSORS) + [
                str(scratch / f"dcpctl-{kind}" / "model.safetensors"),
                str(scratch / f"torch-{kind}.safetensors")])
            print(f"{kind}: dcpctl and torch outputs hold the same tensors "
                  f"(checked in {checked.seconds:.0f} s)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _report(source, source_bytes, largest, results)


def _report(source: Path, source_bytes: int, largest: int, results: dict) -> None:
    mib = 2**20
    print(f"input: {source} ({source_bytes / 1e9:.2f} GB), largest tensor "
          f"{largest / mib:.1f} MiB")
    rows = [(label, f"{m.seconds:.1f}", f"{m.peak_rss_bytes / mib:.0f}")
            for label, m in results.values()]
    print_table(rows, ("what", "seconds", "peak RSS MiB"))
    # --to torch imports torch, so its fixed cost is torch's; the others import no torch.
    for kind, torch_name, fixed_name in (("model", "torch-model", "dcpctl-fixed"),
                                         ("all", "torch-all", "dcpctl-fixed"),
                                         ("torch", "torch-save", "import")):
        ours, theirs = results[f"dcpctl-{kind}"][1], results[torch_name][1]
        fixed = results[fixed_name][1].peak_rss_bytes
        print(f"{kind}: dcpctl {theirs.seconds / ours.seconds:.2f}x faster; peak RSS "
              f"{ours.peak_rss_bytes / mib:.0f} MiB (fixed cost {fixed / mib:.0f} MiB + "
              f"{(ours.peak_rss_bytes - fixed) / mib:.0f} MiB) vs "
              f"{theirs.peak_rss_bytes / mib:.0f} MiB")


if __name__ == "__main__":
    main()
