"""torch.save's framing around a tensor, coded small (stream version 2).

The head of an archive (its records up to the tensor's bytes) is a BYTES block coded with zstd
and the framing dictionary (framing_dictionary_v2.py): tens of bytes, where plain zstd leaves
hundreds, since each item's framing is too short for zstd to find its repeats. The tail (the
records after the tensor's bytes and the central directory) is all zip structure that the head
and the payload's length fix, but for the payload's CRC-32, the `version` record and the
serialization id: a TAIL block holds just those, and the tail is rebuilt from them."""

from __future__ import annotations

import re

import zstandard

from dcpctl.format.codecs.floatsplit.framing_dictionary_v2 import DICTIONARY
from dcpctl.format.codecs.floatsplit.stream_format import TAIL_BLOCK, TAIL_HEADER
from dcpctl.format.codecs.per_thread import PerThread
from dcpctl.format.torch_save.writer import ArchiveTail, rebuilt_tail, tail_fields

_DICTIONARY = zstandard.ZstdCompressionDict(DICTIONARY, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
_compressors: PerThread[dict[int, zstandard.ZstdCompressor]] = PerThread(dict)
_decompressors: PerThread[zstandard.ZstdDecompressor] = PerThread(
    lambda: zstandard.ZstdDecompressor(dict_data=_DICTIONARY))


def framing_compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor with the dictionary at `level`: its frames record their content
    size, no checksum and no dictionary id (the stream's version names the dictionary)."""
    cache = _compressors.get()
    compressor = cache.get(level)
    if compressor is None:
        # Digested once per level: loading the dictionary into each frame costs more than
        # coding a short framing.
        dictionary = zstandard.ZstdCompressionDict(DICTIONARY,
                                                   dict_type=zstandard.DICT_TYPE_RAWCONTENT)
        dictionary.precompute_compress(level=level)
        compressor = cache[level] = zstandard.ZstdCompressor(
            level=level, dict_data=dictionary, write_checksum=False, write_content_size=True,
            write_dict_id=False)
    return compressor


def framing_decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor with the dictionary."""
    return _decompressors.get()


TORCH_VERSION_RECORD = re.compile(rb"[0-9]+\n")
"""The data of the `version` record torch.save writes (`3\n`): a TAIL block holds no other,
so that the rebuilt record, whose CRC-32 is worked out anew, cannot carry a damaged one."""


def tail_block(head: bytes, payload_bytes: int, tail: bytes) -> bytes | None:
    """The TAIL block that stands for `tail`, the bytes after the payload of a torch.save archive
    whose head (its first block) is `head`, where torch's layout lets the tail be rebuilt from
    the fields that vary; else None."""
    fields = tail_fields(head, payload_bytes, tail)
    if fields is None:
        return None
    digits = fields.serialization_id
    if (not (digits.isdigit() and digits.isascii()) or max(len(digits), len(fields.version)) > 255
            or not TORCH_VERSION_RECORD.fullmatch(fields.version)):
        return None
    value = int(digits)
    value_bytes = value.to_bytes((value.bit_length() + 7) // 8, "little")
    return (TAIL_HEADER.pack(TAIL_BLOCK, fields.payload_crc, len(fields.version), len(digits),
                             len(value_bytes)) + fields.version + value_bytes)


def tail_block_size(view, position: int) -> int | None:
    """Bytes of the TAIL block at position, once its header is in view."""
    if position + TAIL_HEADER.size > len(view):
        return None
    _, _, version_bytes, _, value_bytes = TAIL_HEADER.unpack_from(view, position)
    return TAIL_HEADER.size + version_bytes + value_bytes


def tail_of_block(block, head: bytes, payload_bytes: int) -> bytes | None:
    """The bytes a whole TAIL block stands for, after `head` and payload_bytes of payload; None
    where its fields cannot be the end of such an archive."""
    _, payload_crc, version_bytes, digits, value_bytes = TAIL_HEADER.unpack_from(block)
    version = bytes(block[TAIL_HEADER.size:TAIL_HEADER.size + version_bytes])
    value = int.from_bytes(block[TAIL_HEADER.size + version_bytes:], "little")
    serialization_id = str(value).zfill(digits).encode()
    if len(serialization_id) != digits or not TORCH_VERSION_RECORD.fullmatch(version):
        return None
    return rebuilt_tail(head, payload_bytes, ArchiveTail(payload_crc, version, serialization_id))
