"""Running a command as the ranks of a torchrun job, for the command line (execution/)."""

from dcpctl.execution.torchrun import join_torchrun, launched_by_torchrun

__all__ = ["join_torchrun", "launched_by_torchrun"]
