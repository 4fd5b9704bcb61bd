"""One module per operation; each returns a report dataclass and never prints or exits."""
