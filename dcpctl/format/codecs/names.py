"""The names of stream codecs and the transform descriptors that select them.

Kept apart from codecs.py, which imports zstandard and numpy, so that naming the codec of an
item (as `inspect` does for every item) costs no heavy imports.
"""

from __future__ import annotations

from typing import Sequence

ZSTD_DESCRIPTOR = "stream.zstd/1"
FLOATSPLIT_NAME = "dcpctl.floatsplit"
FLOATSPLIT_DESCRIPTOR = f"{FLOATSPLIT_NAME}/2"
"""What dcpctl writes; it reads versions 1 and 2 (FLOATSPLIT_MAJOR_VERSIONS)."""
FLOATSPLIT_MAJOR_VERSIONS = ("1", "2")
IDENTITY_NAME, ZSTD, FLOATSPLIT = "none", "zstd", "floatsplit"
# descriptor name -> (codec, the major versions dcpctl reads)
_CODECS_BY_DESCRIPTOR_NAME = {"stream.zstd": (ZSTD, ("1",)),
                              FLOATSPLIT_NAME: (FLOATSPLIT, FLOATSPLIT_MAJOR_VERSIONS)}


def codec_name_for_descriptors(descriptors: Sequence[str] | None) -> str | None:
    """`none`, `zstd` or `floatsplit` for the codec that decodes these transform descriptors;
    None when dcpctl has no codec for them."""
    if not descriptors:
        return IDENTITY_NAME
    if len(descriptors) == 1:
        name, _, version = descriptors[0].partition("/")
        codec, majors = _CODECS_BY_DESCRIPTOR_NAME.get(name, (None, ()))
        if version.partition(".")[0] in majors:
            return codec
    return None


def describe_codec(descriptors: Sequence[str] | None) -> str:
    """A short human name for an item's transforms: `none`, `zstd`, `floatsplit` or the raw
    descriptors."""
    return codec_name_for_descriptors(descriptors) or "+".join(descriptors or ())
