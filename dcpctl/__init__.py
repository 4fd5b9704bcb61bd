"""dcpctl: inspect, compress, reshard, verify and convert PyTorch Distributed Checkpoints offline."""

from __future__ import annotations

from dcpctl.version import __version__

__all__ = ["FloatSplit", "__version__", "storage_reader", "storage_writer"]


def storage_reader(path):
    """A torch `StorageReader` for the checkpoint at path, a local directory or a URL
    (`s3://bucket/run/step-100`, any fsspec protocol), that decodes every codec dcpctl writes:
    `dcp.load(state_dict, storage_reader=dcpctl.storage_reader(path))`. From an object store it
    fetches only the byte ranges the load needs, several at once."""
    from dcpctl.ops.torch_loading import storage_reader as new_storage_reader

    return new_storage_reader(path)


def storage_writer(path, codec="floatsplit", level=None, thread_count=1, **writer_options):
    """A torch `StorageWriter` that saves to path (a local directory or a URL) with every item
    coded as it is written: `dcp.save(state_dict, storage_writer=dcpctl.storage_writer(path,
    thread_count=8))`, from any number of ranks, and `dcp.async_save` too. codec is `floatsplit`
    (dcpctl's, the smallest; loaded by `dcpctl.storage_reader`), `zstd` (torch's own ZStandard,
    which stock torch loads) or `none`; level is floatsplit's: 1 by default, which codes for
    speed; 3, what `dcpctl compress` writes, is 1 to 5% smaller and codes in 1.2 to 2.4 times
    the time. Other keywords go to torch's FileSystemWriter (for a URL, its FsspecWriter, and
    on to fsspec)."""
    from dcpctl.ops.torch_saving import storage_writer as new_storage_writer

    return new_storage_writer(path, codec, level, thread_count, **writer_options)


def __getattr__(name):
    # FloatSplit is a torch extension class: importing torch waits until it is asked for.
    if name == "FloatSplit":
        from dcpctl.format.codecs.torch_extension import FloatSplit

        return FloatSplit
    raise AttributeError(f"module 'dcpctl' has no attribute {name!r}")
