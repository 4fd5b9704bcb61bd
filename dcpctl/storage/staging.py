"""A new output file or directory, written under a hidden temporary sibling name and renamed
into place at the end, so that a killed run never leaves a half output under the real name."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dcpctl.errors import OutputError
from dcpctl.failpoints import Failpoint, failpoint
from dcpctl.stopping import finishing_first
from dcpctl.storage.local import fsync_directory, new_token, temporary_name


class StagedOutput:
    """Where an output is written (`path`) before `publish` renames it to `destination`. A
    destination that is, holds or lies inside the source is refused; an existing one is
    refused unless overwrite (an empty directory is always taken)."""

    def __init__(self, destination: Path, overwrite: bool, source: Path,
                 is_directory: bool = True) -> None:
        refuse_overlap(source, destination)
        check_destination(destination, overwrite, is_directory)
        self.destination = destination
        self.is_directory = is_directory
        self.token = new_token()
        self.path = destination.parent / temporary_name(f".{destination.name}", self.token)
        if is_directory:
            self.path.mkdir(parents=True)
        else:
            destination.parent.mkdir(parents=True, exist_ok=True)

    def publish(self) -> None:
        """Rename the finished output into place, replacing what was there."""
        if self.is_directory:
            fsync_directory(self.path)
        failpoint(Failpoint.BEFORE_PUBLISH)
        with finishing_first():  # never stopped between moving the old output aside and in
            if self.is_directory and self.destination.exists():
                aside = self.destination.parent / temporary_name(
                    f".{self.destination.name}.old", self.token)
                os.replace(self.destination, aside)
                os.replace(self.path, self.destination)
                shutil.rmtree(aside)
            else:
                os.replace(self.path, self.destination)
            fsync_directory(self.destination.parent)

    def abort(self) -> None:
        """Remove the unfinished output; the destination stays as it was."""
        if self.is_directory:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            self.path.unlink(missing_ok=True)


def refuse_overlap(source: Path, destination: Path) -> None:
    """Refuse an output that is the input, holds it, or lies inside it, whatever --overwrite
    says: replacing it would delete the input, and writing inside it would change it."""
    source_real, destination_real = os.path.realpath(source), os.path.realpath(destination)
    if destination_real == source_real:
        raise OutputError(f"is the input {source}; give another output", path=destination)
    if _lies_within(source_real, destination_real):
        raise OutputError(f"holds the input {source}: replacing it would delete the input; "
                          "give another output", path=destination)
    if _lies_within(destination_real, source_real):
        raise OutputError(f"lies inside the input {source}; give an output outside it",
                          path=destination)


def _lies_within(inner: str, outer: str) -> bool:
    return os.path.commonpath([inner, outer]) == outer and inner != outer


def check_destination(destination: Path, overwrite: bool, is_directory: bool = True) -> None:
    """Refuse a destination of the wrong kind, or one holding data, unless overwrite."""
    if is_directory:
        if destination.is_symlink() or (destination.exists() and not destination.is_dir()):
            raise OutputError("exists and is not a directory", path=destination)
        holds_data = destination.exists() and any(destination.iterdir())
    else:
        if destination.is_dir() and not destination.is_symlink():
            raise OutputError("is a directory; give a file name", path=destination)
        holds_data = destination.exists() or destination.is_symlink()
    if holds_data and not overwrite:
        what = "exists and is not empty" if is_directory else "exists"
        raise OutputError(f"{what} (pass --overwrite to replace it)", path=destination)
