"""Deleting through directory descriptors: everything inside goes, nothing outside."""

from __future__ import annotations

import os

import pytest

from dcpctl.storage.local import empty_directory


def _emptied(directory) -> None:
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        empty_directory(descriptor)
    finally:
        os.close(descriptor)


def test_everything_inside_goes_and_what_links_point_to_stays(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    target = tmp_path / "target"
    (target / "a" / "b").mkdir(parents=True)
    (target / "a" / "b" / "file").write_text("x")
    (target / "a" / "sibling").mkdir()
    (target / "top").write_text("x")
    (target / "a" / "link").symlink_to(outside)
    _emptied(target)
    assert list(target.iterdir()) == [] and (outside / "keep").read_text() == "x"


def test_a_tree_deeper_than_pythons_recursion_limit_is_emptied(tmp_path, deep_tree):
    target = tmp_path / "target"
    target.mkdir()
    deep_tree(target)
    _emptied(target)
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("written, shown", [
    ("/r/.out.dcpctl-0123456789ab.tmp/__0_0.distcp", "/r/out/__0_0.distcp"),
    ("/r/.out.dcpctl-0123456789ab.tmp/sub/model.safetensors", "/r/out/sub/model.safetensors"),
    (".model.pt.dcpctl-0123456789ab.tmp/model.pt", "model.pt"),  # a file output
    ("/r/ck/__0_0.distcp.dcpctl-0123456789ab.tmp", "/r/ck/__0_0.distcp.dcpctl-0123456789ab.tmp"),
    ("/r/ck/.metadata.dcpctl-0123456789ab.tmp", "/r/ck/.metadata.dcpctl-0123456789ab.tmp"),
    ("/r/.out.dcpctl-0123456789ab.tmp", "/r/.out.dcpctl-0123456789ab.tmp"),
    ("/r/.out.dcpctl-notatoken.tmp/x", "/r/.out.dcpctl-notatoken.tmp/x"),
])
def test_a_file_in_a_staging_directory_is_named_where_it_is_published(written, shown):
    """A full disk named `.out.dcpctl-<token>.tmp/__0_0.distcp`, a directory gone by the time
    the user reads it; an in-place run's new file keeps its own name (the file it replaces
    is another)."""
    from dcpctl.storage.local import as_published

    assert as_published(written) == shown
