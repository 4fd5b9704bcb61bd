"""`reshard`: lay a checkpoint out for a new world size, as a real N-rank FSDP2 save would."""
