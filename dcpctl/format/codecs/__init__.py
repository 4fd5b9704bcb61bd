"""Stream codecs keyed by DCP transform descriptor: identity, zstd and floatsplit, and torch extensions."""
