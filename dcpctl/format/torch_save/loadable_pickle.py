"""The rule for the pickles dcpctl itself unpickles out of torch.save archives (a tensor item's
data.pkl, an object's): they hold only the opcodes torch.load(weights_only=True) reads, and
number their memo within their own length.

torch's weights_only loader (torch/_weights_only_unpickler.py) reads a protocol-2 subset of
pickle's opcodes, the ones torch.save writes, and refuses any other. Python's unpickler reads
them all, so without this rule dcpctl would accept, and `verify` call sound, an item that stock
torch.distributed.checkpoint.load cannot load. The memo bound matters for a different reason:
CPython's C unpickler sizes its memo table by the largest index a pickle names (gh-115952,
unpickling_memory.py), so one BINPUT of index 2**27 in a 150-byte data.pkl took 2 GB; a pickler
numbers its memo from 0, one index per PUT, so an index past the pickle's length is never
honest.
"""

from __future__ import annotations

import pickle
import pickletools
import struct

from dcpctl.errors import DataError


def _code(opcode: bytes) -> int:
    return opcode[0]


# The opcodes torch's weights_only loader reads (tests compare this with torch's own source),
# and the bytes of each one's argument where they are fixed.
_FIXED_ARGUMENT_BYTES: dict[int, int] = {
    **{_code(opcode): 0 for opcode in (
        pickle.NEWOBJ, pickle.REDUCE, pickle.BUILD, pickle.APPEND, pickle.APPENDS,
        pickle.SETITEM, pickle.SETITEMS, pickle.MARK, pickle.TUPLE, pickle.TUPLE1,
        pickle.TUPLE2, pickle.TUPLE3, pickle.NONE, pickle.NEWFALSE, pickle.NEWTRUE,
        pickle.EMPTY_TUPLE, pickle.EMPTY_LIST, pickle.EMPTY_DICT, pickle.EMPTY_SET,
        pickle.BINPERSID)},
    _code(pickle.BININT): 4, _code(pickle.BININT1): 1, _code(pickle.BININT2): 2,
    _code(pickle.BINFLOAT): 8, _code(pickle.BINGET): 1, _code(pickle.LONG_BINGET): 4,
    _code(pickle.BINPUT): 1, _code(pickle.LONG_BINPUT): 4, _code(pickle.PROTO): 1,
}
_LENGTH_BYTE_ARGUMENT = {_code(pickle.SHORT_BINSTRING), _code(pickle.LONG1)}
_BINUNICODE, _GLOBAL, _STOP = _code(pickle.BINUNICODE), _code(pickle.GLOBAL), _code(pickle.STOP)
_LONG_BINPUT = _code(pickle.LONG_BINPUT)
TORCH_LOADER_OPCODES = frozenset(
    {*_FIXED_ARGUMENT_BYTES, *_LENGTH_BYTE_ARGUMENT, _BINUNICODE, _GLOBAL, _STOP})


def refuse_unloadable_pickle(data: bytes) -> None:
    """Raise DataError unless data is a pickle torch's weights_only loader reads opcode by
    opcode (what it makes of the globals it names is its caller's to judge) whose memo indexes
    lie within its length. Everything after its STOP is ignored, as both unpicklers do."""
    position, end = 0, len(data)
    try:
        while position < end:
            start, code = position, data[position]
            position += 1
            fixed = _FIXED_ARGUMENT_BYTES.get(code)
            if fixed is not None:
                if code == _LONG_BINPUT:
                    (index,) = struct.unpack_from("<I", data, position)
                    if index > end:
                        raise DataError(f"data.pkl puts a memo entry at index {index} (byte "
                                        f"{start}), past its {end} bytes, which no pickler "
                                        "writes")
                position += fixed
            elif code in _LENGTH_BYTE_ARGUMENT:
                position += 1 + data[position]
            elif code == _BINUNICODE:
                position += 4 + struct.unpack_from("<I", data, position)[0]
            elif code == _GLOBAL:
                for _ in range(2):  # module and name, each ended by a newline
                    newline = data.index(b"\n", position)
                    position = newline + 1
            elif code == _STOP:
                return
            else:
                name = _OPCODE_NAMES.get(code, f"0x{code:02x}")
                raise DataError(f"data.pkl holds pickle opcode {name} at byte {start}, which "
                                "torch.load(weights_only=True) does not read")
    except (IndexError, ValueError, struct.error):
        pass
    raise DataError("data.pkl ends before its pickle's STOP opcode")


_OPCODE_NAMES = {ord(opcode.code): opcode.name for opcode in pickletools.opcodes}
