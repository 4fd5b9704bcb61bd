"""Run directories: the checkpoints under them (`ls`) and their retention (`prune`)."""
