"""`python -m dcpctl`."""

from dcpctl.cli.main import main

main()
