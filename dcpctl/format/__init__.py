"""The DCP on-disk format: metadata, stored items and stream codecs. Never prints, never uses click."""
