"""The `dcpctl` command and `python -m dcpctl`."""

import signal
import sys


def main() -> None:
    """Console-script entry point: the command line, once imported."""
    try:
        from dcpctl.cli.main import main as run_command_line
    except KeyboardInterrupt:  # Ctrl-C while starting: said as a command stopped so says it
        sys.stderr.write("Error: interrupted\n")
        sys.exit(128 + signal.SIGINT)
    run_command_line()


if __name__ == "__main__":
    main()
