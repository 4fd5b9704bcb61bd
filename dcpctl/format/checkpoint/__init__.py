"""The checkpoint view: a directory's metadata joined with its files; items, payloads, sharding,
publishing and checksums."""
