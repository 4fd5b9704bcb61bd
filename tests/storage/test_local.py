"""Deleting through directory descriptors: everything inside goes, nothing outside."""

from __future__ import annotations

import os


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
