"""The quick check ls and prune both make of each complete checkpoint of a run directory: each
of its parts opened as `verify --quick` opens it (short of hashing), under a shared lock.

A checkpoint fails it as damaged (the first problem, with its place) or is found in use: another
dcpctl holds it to change it (an in-place compress, SHA256SUMS being written), so what its files
say now is no verdict; it is neither damaged nor checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dcpctl.cycle_collector import paused_cycle_collector
from dcpctl.errors import DcpctlError, LockHeldError, describe_os_error
from dcpctl.format.checkpoint.structure import open_quickly_verified
from dcpctl.format.checkpoint.view import Checkpoint
from dcpctl.ops.runs.scan import CheckpointEntry
from dcpctl.storage.locks import locked_checkpoint


@dataclass
class QuickCheck:
    """What the quick check found: each part opened (when all were), or why not."""

    parts: list[Checkpoint] = field(default_factory=list)
    damage: str | None = None
    in_use: str | None = None

    @property
    def sound(self) -> bool:
        """Every part opened and passed."""
        return self.damage is None and self.in_use is None


def quick_check(entry: CheckpointEntry) -> QuickCheck:
    """Open each part of complete checkpoint entry, holding it shared while it is read."""
    parts = []
    for directory in entry.dcp_directories:
        try:
            with paused_cycle_collector(), locked_checkpoint(directory, exclusive=False):
                parts.append(open_quickly_verified(directory))
        except LockHeldError as error:
            return QuickCheck(in_use=str(error))
        except DcpctlError as error:
            return QuickCheck(damage=str(error))
        except OSError as error:
            return QuickCheck(damage=describe_os_error(error))
    return QuickCheck(parts)
