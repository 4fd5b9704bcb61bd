"""dcpctl's transforms as torch DCP extensions, so that torch's own FileSystemReader loads them."""

from __future__ import annotations

from typing import IO

from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

from dcpctl.format.codecs.base import PieceStream, iter_decoded
from dcpctl.format.codecs.names import FLOATSPLIT_DESCRIPTOR, FLOATSPLIT_NAME
from dcpctl.format.codecs.registry import floatsplit_codec

_READ_BYTES = 4 << 20


class FloatSplitExtension(StreamTransformExtension):
    """Reads items stored with `dcpctl.floatsplit/1`; `dcpctl compress` writes them."""

    @staticmethod
    def registry_name() -> str:
        return FLOATSPLIT_NAME

    @staticmethod
    def from_descriptor(version: str) -> "FloatSplitExtension":
        if version.partition(".")[0] != "1":
            raise ValueError(f"Unknown extension version {FLOATSPLIT_NAME}/{version}; this "
                             f"dcpctl reads {FLOATSPLIT_DESCRIPTOR}")
        return FloatSplitExtension()

    def get_descriptor(self) -> str:
        return FLOATSPLIT_DESCRIPTOR

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        # The encoder needs each tensor's dtype, which a byte stream does not carry.
        raise NotImplementedError(f"{FLOATSPLIT_DESCRIPTOR} is written by `dcpctl compress "
                                  "--codec floatsplit`, not by torch's writer")

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        stored_pieces = iter(lambda: input.read(_READ_BYTES), b"")
        return PieceStream(iter_decoded(floatsplit_codec().new_decoder(), stored_pieces))


def extension_registry() -> ExtensionRegistry:
    """torch's registry (its own zstd included) with every transform dcpctl writes."""
    registry = ExtensionRegistry()
    registry.register(FloatSplitExtension)
    return registry
