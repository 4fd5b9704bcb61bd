"""dcpctl: inspect, compress, reshard, verify and convert PyTorch Distributed Checkpoints offline."""

__version__ = "0.1.0"
