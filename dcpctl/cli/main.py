"""The `dcpctl` command group, and the one place where errors become messages and exit codes."""

from __future__ import annotations

import sys

import click

from dcpctl import __version__
from dcpctl.allocator import reuse_large_buffers
from dcpctl.errors import DcpctlError, describe_os_error


class DcpctlGroup(click.Group):
    """Runs a subcommand and turns every expected failure into one `Error: ...` line."""

    def invoke(self, context: click.Context):
        try:
            return super().invoke(context)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except DcpctlError as error:
            self._fail(context, str(error), error.exit_code)
        except OSError as error:
            self._fail(context, describe_os_error(error), 1)
        except KeyboardInterrupt:
            self._fail(context, "interrupted", 130)
        except Exception as error:  # a bug: say so briefly, traceback with --debug
            self._fail(context, f"internal error: {type(error).__name__}: {error} "
                                "(run with --debug for the traceback)", 1)

    @staticmethod
    def _fail(context: click.Context, message: str, exit_code: int):
        if context.obj and context.obj.get("debug"):
            raise
        click.echo(f"Error: {message}", err=True)
        sys.exit(exit_code)


@click.group(cls=DcpctlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dcpctl")
@click.option("--debug", is_flag=True, help="Show the full traceback when something fails.")
@click.pass_context
def cli(context: click.Context, debug: bool) -> None:
    """Inspect, compress, reshard, verify and convert PyTorch Distributed Checkpoints (DCP).

    A DCP checkpoint is a directory holding a pickled `.metadata` and `__{rank}_{n}.distcp`
    data files, as written by torch.distributed.checkpoint.save (FSDP2, torchtitan,
    torchtune...). dcpctl works offline, with no process group and no GPU. It reads
    `.metadata` with an allowlist and never runs code from it.

    Exit status: 0 on success, 1 when an operation fails, 2 for usage errors.
    """
    context.ensure_object(dict)
    context.obj["debug"] = debug


def register_commands() -> None:
    """Attach every subcommand to the group."""
    from dcpctl.cli.checksum import checksum_command
    from dcpctl.cli.compress import compress_command, decompress_command
    from dcpctl.cli.convert import convert_command
    from dcpctl.cli.inspect import inspect_command
    from dcpctl.cli.ls import ls_command
    from dcpctl.cli.prune import prune_command
    from dcpctl.cli.reshard import reshard_command
    from dcpctl.cli.verify import verify_command

    for command in (inspect_command, compress_command, decompress_command, reshard_command,
                    convert_command, checksum_command, verify_command, ls_command,
                    prune_command):
        cli.add_command(command)


register_commands()


def main() -> None:
    """Console-script entry point."""
    reuse_large_buffers()
    cli(prog_name="dcpctl")
