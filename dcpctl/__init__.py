"""dcpctl: inspect, compress, reshard, verify and convert PyTorch Distributed Checkpoints offline."""

from __future__ import annotations

from dcpctl.version import __version__

__all__ = ["__version__", "storage_reader"]


def storage_reader(path):
    """A torch `StorageReader` for the checkpoint at path, a local directory or a URL
    (`s3://bucket/run/step-100`, any fsspec protocol), that decodes every codec dcpctl writes:
    `dcp.load(state_dict, storage_reader=dcpctl.storage_reader(path))`. From an object store it
    fetches only the byte ranges the load needs, several at once."""
    from dcpctl.ops.torch_loading import storage_reader as new_storage_reader

    return new_storage_reader(path)
