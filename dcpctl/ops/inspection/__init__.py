"""`inspect`: what a checkpoint holds, from its metadata and file sizes alone."""
