"""The `dcpctl` command group, and the one place where errors become messages and exit codes."""

from __future__ import annotations

import importlib
import json
import select
import signal
import sys

import click

from dcpctl.allocator import reuse_large_buffers
from dcpctl.cli.process import RUNS_AS_PROCESS, end_at_once_if_stopped, end_process_now
from dcpctl.cli.render import escape_control_characters, print_failure
from dcpctl.cycle_collector import freeze_built_objects_on_resume
from dcpctl.errors import DcpctlError, describe_os_error, name_and_message
from dcpctl.library_logs import quiet_library_logs, show_library_logs
from dcpctl.ops.distributed import join_torchrun, launched_by_torchrun
from dcpctl.ops.storage_options import add_storage_options, without_secrets
from dcpctl.stopping import Terminated, describe_stop, stop_on_signals
from dcpctl.unpickling_memory import bound_unpickling_memory
from dcpctl.version import __version__

# Each command's module is imported only when that command runs (or help lists it): `inspect`
# should not pay for the numpy, zstandard and tqdm that other commands import.
_COMMAND_LOCATIONS = {
    "inspect": ("dcpctl.cli.inspection", "inspect_command"),
    "compress": ("dcpctl.cli.compress", "compress_command"),
    "decompress": ("dcpctl.cli.compress", "decompress_command"),
    "reshard": ("dcpctl.cli.reshard", "reshard_command"),
    "convert": ("dcpctl.cli.convert", "convert_command"),
    "checksum": ("dcpctl.cli.checksum", "checksum_command"),
    "verify": ("dcpctl.cli.verify", "verify_command"),
    "ls": ("dcpctl.cli.ls", "ls_command"),
    "prune": ("dcpctl.cli.prune", "prune_command"),
}


class DcpctlGroup(click.Group):
    """Runs a subcommand and turns every expected failure into one `Error: ...` line; imports
    each subcommand's module on first use."""

    def list_commands(self, context: click.Context) -> list[str]:
        return sorted({*_COMMAND_LOCATIONS, *self.commands})

    def get_command(self, context: click.Context, name: str) -> click.Command | None:
        if name not in self.commands and name in _COMMAND_LOCATIONS:
            module_name, attribute = _COMMAND_LOCATIONS[name]
            self.add_command(getattr(importlib.import_module(module_name), attribute), name)
        return self.commands.get(name)

    def invoke(self, context: click.Context):
        try:
            return super().invoke(context)
        except click.NoSuchOption as error:
            group_options = {name for option in context.command.params for name in option.opts}
            if error.option_name in group_options:  # given after the command, not before it
                error.message = (f"{error.option_name} goes before the command, as in "
                                 f"`dcpctl {error.option_name} ... "
                                 f"{context.invoked_subcommand or 'COMMAND'} ...`")
                error.possibilities = None  # click's guess at a command's own option
            raise
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except DcpctlError as error:
            self._fail(context, str(error), error.exit_code)
        except OSError as error:
            if isinstance(error, BrokenPipeError) and _stdout_reader_gone():
                raise  # `dcpctl inspect CKPT --json | head`: click ends quietly, as `cat` does
            self._fail(context, describe_os_error(error), 1)
        except KeyboardInterrupt as stop:
            self._fail(context, _said_of_stop(stop), 128 + signal.SIGINT)
        except Terminated as stop:
            self._fail(context, _said_of_stop(stop), 128 + stop.signal_number)
        except Exception as error:  # a bug: say so briefly, traceback with --debug
            self._fail(context, f"internal error: {name_and_message(error)} "
                                "(run with --debug for the traceback)", 1)

    @staticmethod
    def _fail(context: click.Context, message: str, exit_code: int):
        if context.obj and context.obj.get("debug"):
            raise
        print_failure(context, without_secrets(message), exit_code)
        sys.exit(exit_code)


def _stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reading end was closed."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor, or no poll here
        return False


@click.group(cls=DcpctlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dcpctl")
@click.option("--debug", is_flag=True, help="Show the full traceback when something fails.")
@click.option("--storage-option", "storage_options", metavar="KEY=VALUE", multiple=True,
              help="An fsspec storage option for every URL (s3://, gs://...), repeatable: "
                   "--storage-option anon=true, --storage-option profile=training. VALUE is "
                   "read as JSON where it parses (true, 3, {...}), else as a string. "
                   "DCPCTL_STORAGE_OPTIONS may hold them as one JSON object.")
@click.pass_context
def cli(context: click.Context, debug: bool, storage_options: tuple[str, ...]) -> None:
    """Inspect, compress, reshard, verify and convert PyTorch Distributed Checkpoints (DCP).

    A DCP checkpoint is a directory holding a pickled `.metadata` and `__{rank}_{n}.distcp`
    data files, as written by torch.distributed.checkpoint.save (FSDP2, torchtitan,
    torchtune...). dcpctl works offline, with no process group and no GPU. It reads
    `.metadata` with an allowlist and never runs code from it.

    Every command takes a URL wherever it takes a path: s3://bucket/run/step-100, or any fsspec
    protocol with ranged reads (gs://, az://...) once its package is installed (`pip install
    'dcpctl[s3]'` for S3). Credentials and endpoints come the way boto finds them (environment,
    ~/.aws, instance roles; AWS_ENDPOINT_URL_S3 for an S3-compatible store).

    Commands that move data (compress, decompress, reshard, convert, verify, checksum) take
    --workers N to share the work among N processes on this machine (by default a process per
    core for a local checkpoint of 256 MiB a core or more), and run across machines under
    torchrun, each rank doing its share and rank 0 publishing; the output is the same
    byte for byte either way:

    \b
      torchrun --standalone --nproc-per-node 8 -m dcpctl reshard CKPT --ranks 256 -o OUT
      srun --nodes 4 --ntasks-per-node 1 torchrun --nnodes 4 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 -m dcpctl compress CKPT -o OUT

    (SLURM: one torchrun per node, as above; a shared file system or a bucket for CKPT/OUT.
    Every rank runs the same command line: a job whose ranks were started with different ones
    does nothing.)

    Exit status: 0 on success, 1 when an operation fails, 2 for usage errors, 75 when
    another dcpctl holds the checkpoint or output, or another run changed it meanwhile
    (nothing done: try again later), 128 + the signal's number when stopped by Ctrl-C,
    SIGTERM or SIGHUP (temporary files removed).
    """
    context.ensure_object(dict)
    context.obj["debug"] = debug
    if debug:
        show_library_logs(in_workers=bool(context.obj.get(RUNS_AS_PROCESS)))
    add_storage_options(dict(_parsed_storage_option(text) for text in storage_options))


def _parsed_storage_option(text: str) -> tuple[str, object]:
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise click.BadParameter("takes KEY=VALUE; one given has no KEY= (its value is not "
                                 "shown: it may be a secret)", param_hint="--storage-option")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def main() -> None:
    """The command line: set the process up, then run the command (dcpctl/__main__.py starts
    it)."""
    reuse_large_buffers()
    quiet_library_logs()
    bound_unpickling_memory()
    freeze_built_objects_on_resume()
    stop_on_signals()
    if launched_by_torchrun():
        # Without the teardown: with the gloo group still alive, a rank's interpreter shutdown
        # at times ends in SIGABRT (`terminate called without an active exception`), which
        # torchrun reports as the job's failure. The command is over, its output said.
        end_process_now(_run_as_torchrun_rank())
    try:
        cli(prog_name="dcpctl", obj={RUNS_AS_PROCESS: True})
    except SystemExit as exit:
        end_at_once_if_stopped(_status_of(exit))
        raise


def _said_of_stop(stop: KeyboardInterrupt | Terminated) -> str:
    """describe_stop; under torchrun, whose agent stops every rank with SIGTERM once one has
    failed or been killed (which rank 0 then never hears of), where to find which one, if
    one did (a scheduler's SIGTERM stops them all as well)."""
    said = describe_stop(stop)
    if isinstance(stop, Terminated) and launched_by_torchrun():
        said += (" (torchrun stops every rank once one fails or is killed: where one did, the "
                 "root cause in its summary below names it)")
    return said


def _run_as_torchrun_rank() -> int:
    """Rank 0 runs the command, handing each job's shares to every rank; the other ranks do
    their shares and exit with rank 0's status (execution/torchrun.py)."""
    try:
        team = join_torchrun()
        try:
            team.check_same_command(sys.argv[1:])
        except DcpctlError as error:  # on rank 0: the other ranks are told to end
            team.end(error.exit_code)
            raise
        if team.rank != 0:
            return team.serve()
    except DcpctlError as error:  # ranks that differ, or the job lost: said as rank 0 says it
        click.echo(f"Error: {escape_control_characters(without_secrets(str(error)))}",
                   err=True)
        return error.exit_code
    except KeyboardInterrupt as stop:  # said as rank 0's command says it (DcpctlGroup.invoke)
        click.echo(f"Error: {_said_of_stop(stop)}", err=True)
        return 128 + signal.SIGINT
    except Terminated as stop:
        click.echo(f"Error: {_said_of_stop(stop)}", err=True)
        return 128 + stop.signal_number
    exit_code = 1
    try:
        cli(prog_name="dcpctl", obj={}, standalone_mode=True)  # the process goes on: see end
        exit_code = 0
    except SystemExit as exit:
        exit_code = _status_of(exit)
    finally:
        end_at_once_if_stopped(exit_code)  # a stop while the other ranks hear the end
        team.end(exit_code)
    return exit_code


def _status_of(exit: SystemExit) -> int:
    """The exit status a SystemExit gives the process."""
    return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
