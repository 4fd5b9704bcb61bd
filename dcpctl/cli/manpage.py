"""Generate man/dcpctl.1 from the click commands: `python -m dcpctl.cli.manpage > man/dcpctl.1`.

The page is built from each command's own parameters (names, metavar, help, default), not from
click's help formatting, so the same commands give the same page whatever click release is
installed.
"""

from __future__ import annotations

import inspect

import click

from dcpctl.cli.main import cli
from dcpctl.version import __version__


def _escape(text: str) -> str:
    escaped = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line
                     for line in escaped.splitlines())


def _paragraphs(help_text: str) -> list[str]:
    """Click help text split into paragraphs; `\\b` blocks keep their line breaks."""
    out = []
    for block in inspect.cleandoc(help_text).split("\n\n"):
        if block.startswith("\b\n"):
            out.append(".nf\n" + _escape(block[2:]) + "\n.fi")
        else:
            out.append(_escape(" ".join(block.split())))
    return out


def _metavar(option: click.Option) -> str:
    """What follows an option's names: its metavar, its choices, or its type's name."""
    if option.is_flag:
        return ""
    if option.metavar:
        return option.metavar
    if isinstance(option.type, click.Choice):
        return "[" + "|".join(map(str, option.type.choices)) + "]"
    return option.type.name.upper()


def _option_help(option: click.Option) -> str:
    """The option's help, then its default and whether it is required."""
    parts = [option.help or ""]
    if isinstance(option.type, click.IntRange):
        low, high = option.type.min, option.type.max
        parts.append(f"[{low}<=x<={high}]" if low is not None and high is not None
                     else f"[x>={low}]" if low is not None else f"[x<={high}]")
    if isinstance(option.show_default, str):
        parts.append(f"[default: {option.show_default}]")
    elif option.show_default and option.default is not None and not option.is_flag:
        parts.append(f"[default: {option.default}]")
    if option.required:
        parts.append("[required]")
    return " ".join(part for part in parts if part)


def _options_section(command: click.Command) -> list[str]:
    lines = []
    for parameter in command.params:
        if not isinstance(parameter, click.Option) or parameter.hidden:
            continue
        names = ", ".join([*parameter.opts, *parameter.secondary_opts])
        metavar = _metavar(parameter)
        lines += [".TP", f"\\fB{_escape(names)}\\fR" + (f" {_escape(metavar)}" if metavar else ""),
                  _escape(_option_help(parameter))]
    return lines + [".TP", "\\fB\\-h, \\-\\-help\\fR", "Show the help and exit."]


def _usage(name: str, command: click.Command) -> str:
    arguments = [parameter.human_readable_name.upper() for parameter in command.params
                 if isinstance(parameter, click.Argument)]
    return " ".join(["dcpctl", name, "[OPTIONS]", *arguments])


def render_manpage() -> str:
    """The roff source of dcpctl(1)."""
    root_context = click.Context(cli, info_name="dcpctl", **cli.context_settings)
    lines = [
        f'.TH DCPCTL 1 "" "dcpctl {__version__}" "User Commands"',
        ".SH NAME",
        "dcpctl \\- inspect, compress, reshard, verify and convert PyTorch Distributed Checkpoints",
        ".SH SYNOPSIS",
        "\\fBdcpctl\\fR [\\fIOPTIONS\\fR] \\fICOMMAND\\fR [\\fIARGS\\fR]...",
        ".SH DESCRIPTION",
    ]
    for paragraph in _paragraphs(cli.help or ""):
        lines += [".PP", paragraph]
    lines += [".SH OPTIONS", *_options_section(cli), ".SH COMMANDS"]
    for name in cli.list_commands(root_context):
        command = cli.get_command(root_context, name)
        lines += [".SS " + _escape(_usage(name, command))]
        for paragraph in _paragraphs(command.help or ""):
            lines += [".PP", paragraph]
        lines += [".PP", "Options:", *_options_section(command)]
    lines += [".SH EXIT STATUS", "0 on success; 1 when an operation fails (or, for verify, "
              "finds damage); 2 for usage errors; 75 when another dcpctl holds the checkpoint "
              "or output, or another run changed it meanwhile (nothing done: try again later).",
              ".SH SEE ALSO", "README.md in the dcpctl source tree."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    click.echo(render_manpage(), nl=False)
