"""The byte layout of a floatsplit stream, version 1 (docs/floatsplit.md says it in prose).

A stream is MAGIC, then blocks, each starting with its kind: a BYTES_BLOCK is one sub-stream of
plain bytes; a FLOATS_BLOCK is FLOATS_HEADER (kind, layout code, element count) then one
sub-stream per byte plane; the END_BLOCK (END_HEADER: kind, decoded length of the whole item)
ends the stream. A sub-stream is STREAM_HEADER (coding, decoded length, stored length) then its
stored bytes: raw, or one zstd frame.
"""

from __future__ import annotations

import struct

MAGIC = b"DCFS"
END_BLOCK, BYTES_BLOCK, FLOATS_BLOCK = 0, 1, 2
RAW_CODING, ZSTD_CODING = 0, 1
MAX_BLOCK_BYTES = 4 << 20
"""The most decoded bytes dcpctl puts in one block."""
MAX_STREAM_BYTES = 16 << 20
"""The most bytes a decoder accepts a sub-stream to claim; larger claims are damage."""
STREAM_HEADER = struct.Struct("<BII")  # coding, decoded length, stored length
FLOATS_HEADER = struct.Struct("<BBI")  # block kind, layout code, element count
END_HEADER = struct.Struct("<BQ")  # block kind, decoded length of the whole item
