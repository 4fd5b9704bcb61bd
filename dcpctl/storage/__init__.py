"""Where bytes live: local directories now (atomic writes, staged outputs)."""
