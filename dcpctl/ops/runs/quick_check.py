"""The quick check ls and prune both make of each complete checkpoint of a run directory: each
of its parts opened as `verify --quick` opens it (short of hashing), under a shared lock.

A checkpoint passes it; or fails it as damaged (the first problem, with its place), and then
lacks bytes (data files missing or short, as a save or copy cut short leaves it: prune may
delete it as it does an incomplete one) or not; or cannot be read (a `.metadata` that dcpctl
does not read, which torch may: a class it does not know, a layout it does not read yet; a
file system or store that fails it): no verdict, and prune never deletes it; or is found in
use: another dcpctl holds it to change it (an in-place compress, SHA256SUMS being written), so
what its files say now is no verdict either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dcpctl.cycle_collector import paused_cycle_collector
from dcpctl.errors import (NO_SIGN_OF_DAMAGE, DataError, DcpctlError, LockHeldError, MetadataError,
                           UnsafePathError, describe_os_error)
from dcpctl.format.checkpoint.problems import ProblemsError, Rule
from dcpctl.format.checkpoint.structure import open_quickly_verified
from dcpctl.format.checkpoint.view import Checkpoint
from dcpctl.ops.runs.scan import CheckpointEntry
from dcpctl.storage.locks import locked_checkpoint


@dataclass
class QuickCheck:
    """What the quick check found: each part opened (when all were), or why not."""

    parts: list[Checkpoint] = field(default_factory=list)
    damage: str | None = None
    lacks_bytes: bool = False
    """Of a damaged one: every problem is a data file missing or short."""
    unreadable: str | None = None
    in_use: str | None = None

    @property
    def sound(self) -> bool:
        """Every part opened and passed."""
        return self.damage is None and self.unreadable is None and self.in_use is None

    @property
    def problem(self) -> str | None:
        """What makes the checkpoint damaged, or unreadable."""
        return self.damage or self.unreadable

    @property
    def state(self) -> str:
        """What ls and prune call a complete checkpoint that had this check (STATES)."""
        return ("damaged" if self.damage is not None else "unreadable"
                if self.unreadable is not None else "in use" if self.in_use is not None
                else "complete")


STATES = ("complete", "incomplete", "damaged", "unreadable", "in use")
"""A checkpoint's state as ls and prune show it (`state` in their JSON): complete and sound as
far as the quick check sees; incomplete (no `.metadata`, or a trainer's last file missing);
damaged; unreadable to dcpctl; in use by another dcpctl that changes it."""


def state_of(entry: CheckpointEntry, check: QuickCheck | None) -> str:
    """A checkpoint's state (STATES), given its quick check where it had one."""
    if not entry.complete:
        return "incomplete"
    return check.state if check is not None else "complete"


_BYTES_MISSING = frozenset({Rule.MISSING_FILE, Rule.TRUNCATED})


def quick_check(entry: CheckpointEntry) -> QuickCheck:
    """Open each part of complete checkpoint entry, holding it shared while it is read."""
    parts = []
    for directory in entry.dcp_directories:
        try:
            with paused_cycle_collector(), locked_checkpoint(directory, exclusive=False):
                parts.append(open_quickly_verified(directory))
        except LockHeldError as error:
            return QuickCheck(in_use=str(error))
        except ProblemsError as error:
            return QuickCheck(damage=str(error), lacks_bytes=all(
                problem.rule in _BYTES_MISSING for problem in error.problems))
        except NO_SIGN_OF_DAMAGE as error:
            return QuickCheck(unreadable=str(error))
        except (MetadataError, UnsafePathError, DataError) as error:  # as verify calls them
            return QuickCheck(damage=str(error))
        except DcpctlError as error:  # a layout dcpctl does not read yet, a store refusing it
            return QuickCheck(unreadable=str(error))
        except OSError as error:
            return QuickCheck(unreadable=describe_os_error(error))
    return QuickCheck(parts)
