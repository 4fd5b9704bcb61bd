"""The byte layout of a floatsplit stream, versions 1 and 2 (docs/floatsplit.md says it in
prose).

A stream is its version's magic, then blocks, each starting with its kind: a BYTES_BLOCK is one
sub-stream of plain bytes; a FLOATS_BLOCK is FLOATS_HEADER (kind, layout code, element count)
then one sub-stream per byte plane; a PREDICTED_BLOCK (version 2) is PREDICTED_HEADER (kind,
layout code, element count, row length, escaped element count) then the sub-streams of
prediction.py; a TAIL_BLOCK (version 2) is TAIL_HEADER (kind, the payload's CRC-32, the
lengths of the fields that follow) then the `version` record's data and the serialization id's
digits as a little-endian integer, and stands for the end of a torch.save archive rebuilt from
them (torch_save/writer.py, rebuilt_tail); the END_BLOCK (END_HEADER: kind, decoded length of
the whole item) ends the stream. A sub-stream is STREAM_HEADER (coding, decoded length, stored
length) then its stored bytes: raw, one zstd frame, or (version 2) one zstd frame made with the
framing dictionary.
"""

from __future__ import annotations

import struct

MAGIC = b"DCFS"
"""Version 1."""
MAGIC_V2 = b"DCF2"
MAGICS = {MAGIC: 1, MAGIC_V2: 2}
END_BLOCK, BYTES_BLOCK, FLOATS_BLOCK, PREDICTED_BLOCK, TAIL_BLOCK = 0, 1, 2, 3, 4
RAW_CODING, ZSTD_CODING, DICTIONARY_CODING = 0, 1, 2
# What each version may hold beyond version 1.
KINDS_BY_VERSION = {1: (END_BLOCK, BYTES_BLOCK, FLOATS_BLOCK),
                    2: (END_BLOCK, BYTES_BLOCK, FLOATS_BLOCK, PREDICTED_BLOCK, TAIL_BLOCK)}
CODINGS_BY_VERSION = {1: (RAW_CODING, ZSTD_CODING),
                      2: (RAW_CODING, ZSTD_CODING, DICTIONARY_CODING)}
MAX_BLOCK_BYTES = 4 << 20
"""The most decoded bytes dcpctl puts in one block."""
MAX_STREAM_BYTES = 16 << 20
"""The most bytes a decoder accepts a sub-stream to claim; larger claims are damage."""
MAX_HEAD_BYTES = 64 << 10
"""The most bytes of a torch.save archive's head (its records before the tensor's bytes) that
dcpctl's writer looks through and codes as the first block, and that its reader keeps for a
TAIL block to end."""
STREAM_HEADER = struct.Struct("<BII")  # coding, decoded length, stored length
FLOATS_HEADER = struct.Struct("<BBI")  # block kind, layout code, element count
# block kind, layout code, element count, row length, escaped element count
PREDICTED_HEADER = struct.Struct("<BBIII")
# block kind, payload CRC-32, version data length, serialization id digits, id integer length
TAIL_HEADER = struct.Struct("<BIBBB")
END_HEADER = struct.Struct("<BQ")  # block kind, decoded length of the whole item
