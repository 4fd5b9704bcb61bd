"""Work split across processes: the shares of a plan run by local worker processes
(`--workers N`) or by the ranks of a `torchrun` job, their results gathered where the output
is published. See jobs.py."""
