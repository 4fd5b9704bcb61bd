"""Stream codecs keyed by DCP transform descriptor (identity, zstd, floatsplit), and torch
extensions for them."""
