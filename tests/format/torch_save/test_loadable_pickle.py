"""The pickles dcpctl unpickles out of torch.save archives hold only what torch's weights_only
loader reads, with their memo numbered within their length."""

from __future__ import annotations

import io
import pickle
import re
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch._weights_only_unpickler as weights_only_unpickler
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcpctl.errors import DataError
from dcpctl.format.torch_save.loadable_pickle import (TORCH_LOADER_OPCODES,
                                                      refuse_unloadable_pickle)


def torch_loader_opcodes() -> set[int]:
    """The opcodes torch's weights_only Unpickler.load dispatches on, read from its source."""
    source = Path(weights_only_unpickler.__file__).read_text()
    load = source[source.index("    def load(self):"):source.index("    def pop_mark(self):")]
    names = re.findall(r"\b([A-Z][A-Z0-9_]*)\[0\]", load)
    return {getattr(pickle, name)[0] for name in names}


def test_the_opcodes_are_those_torchs_weights_only_loader_reads():
    assert TORCH_LOADER_OPCODES == torch_loader_opcodes()


@pytest.mark.parametrize("value", [
    torch.arange(6.0).reshape(2, 3), torch.zeros(0, dtype=torch.bfloat16), torch.tensor(3),
    {"step": 7, "lr": [0.1, 1e-3], "name": "adamw", "betas": (0.9, 0.95), "on": True,
     "none": None, "big": 2**70, "bytes": b"\x00\xff", "set": {1, 2}, "c": 1 + 2j},
])
def test_what_torch_save_writes_passes(value):
    buffer = io.BytesIO()
    torch.save(value, buffer, _use_new_zipfile_serialization=True)
    pickled = _data_pkl(buffer.getvalue())
    refuse_unloadable_pickle(pickled)


def _data_pkl(archive: bytes) -> bytes:
    import zipfile

    with zipfile.ZipFile(io.BytesIO(archive)) as opened:
        name = next(name for name in opened.namelist() if name.endswith("/data.pkl"))
        return opened.read(name)


@pytest.mark.parametrize("data, message", [
    (b"\x80\x02N0N.", "opcode POP at byte 3"),  # Python reads POP, torch's loader does not
    (pickle.dumps({"a": 1}, protocol=4), "opcode FRAME at byte 2"),
    (b"\x80\x02Nr" + struct.pack("<I", 2**27) + b".", "memo entry at index 134217728 "
     r"\(byte 3\), past its 9 bytes"),
    (b"\x80\x02X\xff\xff\x00\x00ab.", "ends before its pickle's STOP opcode"),
    (b"\x80\x02K\x01", "ends before its pickle's STOP opcode"),
    (b"\x80\x02cos\nsystem", "ends before"),  # a GLOBAL whose name has no newline
    (b"", "ends before"),
])
def test_what_torchs_loader_refuses_or_no_pickler_writes_is_refused(data, message):
    with pytest.raises(DataError, match=message):
        refuse_unloadable_pickle(data)


def test_bytes_after_stop_are_ignored_as_both_unpicklers_ignore_them():
    refuse_unloadable_pickle(b"\x80\x02K\x01.\x00\x00garbage")


class _MemoBombPickler(pickle.Pickler):
    """Writes NONE, LONG_BINPUT index, POP before the pickle torch.save asks for."""

    index = 0
    opcodes = b"0"  # POP

    def __init__(self, file, protocol=None):
        super().__init__(file, protocol=protocol)
        self._file = file

    def dump(self, value):
        self._file.write(b"N" + b"r" + struct.pack("<I", self.index) + self.opcodes)
        super().dump(value)


def _checkpoint_with_prefixed_pickle(directory: Path, index: int, opcodes: bytes) -> None:
    """A one-tensor DCP checkpoint whose item's data.pkl starts with a memo put at index (and
    opcodes after it), its CRC-32s right: torch.save writes it, the zip alignment padding
    absorbing the extra bytes, so the item keeps its length."""
    tensor = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    dcp.save({"w": tensor}, checkpoint_id=str(directory), no_dist=True)
    data_file = directory / "__0_0.distcp"
    plain = io.BytesIO()
    torch.save(tensor, plain)
    assert data_file.read_bytes() == plain.getvalue()
    pickler = type("Pickler", (_MemoBombPickler,), {"index": index, "opcodes": opcodes})
    bomb = io.BytesIO()
    torch.save(tensor, bomb,
               pickle_module=types.SimpleNamespace(Pickler=pickler, __name__="pickle"))
    assert len(bomb.getvalue()) == len(plain.getvalue())
    data_file.write_bytes(bomb.getvalue())


# Runs `dcpctl ARGS` as the console script does, then prints its peak RSS in KiB on a last
# stderr line: wait4's, taken by a launcher too small to raise it (ru_maxrss starts at the
# forking process's own high-water mark), since dcpctl may end without running a finally block.
_PEAK_RSS_OF_DCPCTL = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, "-m", "dcpctl", *sys.argv[1:]])
_, status, usage = os.wait4(pid, 0)
print(usage.ru_maxrss, file=sys.stderr)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("command", [["verify"], ["reshard", "--ranks", "2", "-o", "out"]])
def test_a_memo_index_past_the_pickle_is_refused_at_once(tmp_path, command):
    """Such an item made `verify` take 2 GB and call it sound (index 2**27); 2**31 asks for
    32 GiB. Now the command refuses it, in a process that stays small."""
    checkpoint = tmp_path / "ck"
    _checkpoint_with_prefixed_pickle(checkpoint, 2**27, b"0")
    result = subprocess.run([sys.executable, "-c", _PEAK_RSS_OF_DCPCTL, *command[:1],
                             str(checkpoint), *command[1:]],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    peak_kib = int(result.stderr.splitlines()[-1])
    assert result.returncode != 0, output
    assert "past its" in output and "Traceback" not in output, output
    assert peak_kib < 512 * 1024, peak_kib
    assert not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_item_torchs_loader_refuses_is_not_called_sound(tmp_path):
    """An opcode torch's loader does not read (POP), the memo index honest: stock DCP load
    fails on it, so verify must not say ok."""
    checkpoint = tmp_path / "ck"
    _checkpoint_with_prefixed_pickle(checkpoint, 0, b"0")
    with pytest.raises(CheckpointException) as raised:  # a BaseException
        dcp.load({"w": torch.zeros(8, 8)}, checkpoint_id=str(checkpoint), no_dist=True)
    assert "Unsupported operand 48" in str(raised.getrepr())  # 48: POP
    result = subprocess.run([sys.executable, "-m", "dcpctl", "verify", str(checkpoint)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "opcode POP" in result.stdout + result.stderr
