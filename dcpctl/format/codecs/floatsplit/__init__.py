"""The floatsplit codec (`dcpctl.floatsplit/1`): float payloads split into byte planes, each
entropy-coded."""
