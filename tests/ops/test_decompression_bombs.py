"""A compressed item that decodes to far more than its chunk can hold (a decompression bomb):
every command that decodes items stops at what the chunk can hold and names the item."""

from __future__ import annotations

import math
import pickle

import pytest
import zstandard
from conftest import torch_metadata

from dcpctl.errors import DataError
from dcpctl.format.codecs.registry import IDENTITY
from dcpctl.ops.convert.key_selection import KeySelection
from dcpctl.ops.convert.to_safetensors import convert_to_safetensors
from dcpctl.ops.reshard.execution import reshard_checkpoint
from dcpctl.ops.transcode import transcode_checkpoint
from dcpctl.ops.verify.verifier import verify_checkpoint


def test_an_item_that_decodes_far_past_its_tensor_is_refused(copy_fixture, tmp_path):
    """A few KiB of zstd that decode to 64 MiB stand in for one small chunk: reshard, convert
    and decompress refuse it, and verify reports it, naming it, once it passes what the
    chunk can hold."""
    checkpoint = copy_fixture("zstd_fsdp2_2ranks")
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    metadata = torch_metadata(checkpoint)
    key = next(key for key in metadata.storage_data if key.fqn == "model.norm.weight")
    info = metadata.storage_data[key]
    with open(checkpoint / info.relative_path, "ab") as stream:
        info.offset, info.length = stream.tell(), len(bomb)
        stream.write(bomb)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    message = (f"{info.relative_path}: item 'model.norm.weight' at bytes {info.offset}.."
               f"{info.offset + len(bomb)}: decodes to more than")
    with pytest.raises(DataError, match=message):
        reshard_checkpoint(checkpoint, 3, str(tmp_path / "resharded"))
    with pytest.raises(DataError, match=message):
        convert_to_safetensors(checkpoint, tmp_path / "converted", KeySelection())
    with pytest.raises(DataError, match=message):
        transcode_checkpoint(checkpoint, IDENTITY, str(tmp_path / "decompressed"))
    assert not any((tmp_path / name).exists()
                   for name in ("resharded", "converted", "decompressed"))
    problems = verify_checkpoint(checkpoint).problems
    assert [(problem.rule, problem.fqns) for problem in problems] == [
        ("decode", ("model.norm.weight",))]
    chunk = next(chunk for chunk in metadata.state_dict_metadata["model.norm.weight"].chunks
                 if tuple(chunk.offsets) == tuple(key.offset))
    chunk_nbytes = math.prod(chunk.sizes) * metadata.state_dict_metadata[
        "model.norm.weight"].properties.dtype.itemsize
    assert f"decodes to more than {chunk_nbytes + 65536} bytes" in problems[0].message


def test_a_floatsplit_block_past_what_its_item_can_hold_is_refused_before_it_is_decoded():
    """A FLOATS block declaring 4 MiB of float64 (a few KiB stored) in an item that can hold
    80 KiB was decoded whole before the item's bound was checked: a few such blocks cost
    hundreds of MB."""
    import tracemalloc

    from dcpctl.format.codecs.base import PayloadHint, iter_decoded, iter_encoded
    from dcpctl.format.codecs.registry import floatsplit_codec

    payload = bytes(4 << 20)
    codec = floatsplit_codec()
    stream = b"".join(iter_encoded(codec.new_encoder(len(payload), PayloadHint(
        "float64", len(payload))), [payload]))
    assert len(stream) < 64 << 10
    decoder = codec.new_decoder(81920)  # its module imported (and compiled) outside the count
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="more than 81920 bytes"):
            for _ in iter_decoded(decoder, [stream], 81920):
                pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
