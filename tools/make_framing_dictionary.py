"""Writes dcpctl/format/codecs/floatsplit/framing_dictionary_v2.py: the zstd dictionary of
floatsplit version 2, torch.save's own framing around the tensors a DCP checkpoint stores.

Run once, when version 2 was made (torch 2.13). Never run it again for version 2: streams name
the dictionary by their version alone, so its bytes are part of the format (the module records
their SHA-256, and a test checks it). A new dictionary needs a new stream version.
"""

from __future__ import annotations

import base64
import hashlib
import io
import textwrap
from pathlib import Path

import torch

TARGET = (Path(__file__).resolve().parents[1] / "dcpctl" / "format" / "codecs" / "floatsplit"
          / "framing_dictionary_v2.py")
# Least likely first: zstd reaches the dictionary's last bytes with the shortest offsets.
SAMPLES = [
    {"step": 1000, "lr": 3e-4, "epoch": 1},
    torch.zeros(3, 4, 5, dtype=torch.int64),
    torch.zeros(257, dtype=torch.float64),
    torch.zeros(4096, 1024, dtype=torch.float16),
    torch.zeros(4096, dtype=torch.float32),
    torch.zeros(4096, 1024, dtype=torch.float32),
    torch.zeros(4096, dtype=torch.bfloat16),
    torch.zeros(4096, 1024, dtype=torch.bfloat16),
]


def framing(value) -> bytes:
    """What torch.save writes around the value's tensor bytes (all of it for an object)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    saved = buffer.getvalue()
    if not isinstance(value, torch.Tensor):
        return saved
    payload = value.numel() * value.element_size()
    start = saved.index(b"\0" * payload)
    return saved[:start] + saved[start + payload:]


def main() -> None:
    dictionary = b"".join(framing(sample) for sample in SAMPLES)
    encoded = "\n".join(f'    "{line}"' for line in textwrap.wrap(
        base64.b64encode(dictionary).decode(), 88))
    TARGET.write_text(f'''"""The zstd dictionary of floatsplit version 2: torch.save's framing
around tensors of the dtypes checkpoints hold, as torch 2.13 wrote it
(tools/make_framing_dictionary.py). Part of the stream format: never change it for version 2."""

import base64

SHA256 = "{hashlib.sha256(dictionary).hexdigest()}"
DICTIONARY = base64.b64decode(
{encoded}
)
''')


if __name__ == "__main__":
    main()
