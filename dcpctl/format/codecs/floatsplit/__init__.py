"""The floatsplit codec (`dcpctl.floatsplit/2`; version 1 stays readable): float payloads split
into byte planes and predicted from their rows and columns, each plane entropy-coded."""
