"""DCP `.metadata`: its records, safe (allowlisted) reading, structure checks, torch-free
writing."""
