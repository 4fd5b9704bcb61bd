"""Generate man/dcpctl.1 from the click commands: `python -m dcpctl.cli.manpage > man/dcpctl.1`."""

from __future__ import annotations

import inspect

import click

from dcpctl import __version__
from dcpctl.cli.main import cli


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


def _options_section(command: click.Command, context: click.Context) -> list[str]:
    lines = []
    for parameter in command.get_params(context):
        record = parameter.get_help_record(context)
        if record is None:
            continue
        names, help_text = record
        lines += [".TP", f"\\fB{_escape(names)}\\fR", _escape(help_text)]
    return lines


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
    lines += [".SH OPTIONS", *_options_section(cli, root_context), ".SH COMMANDS"]
    for name in cli.list_commands(root_context):
        command = cli.get_command(root_context, name)
        context = click.Context(command, info_name=name, parent=root_context)
        usage = " ".join(command.collect_usage_pieces(context))
        lines += [".SS " + _escape(f"dcpctl {name} {usage}")]
        for paragraph in _paragraphs(command.help or ""):
            lines += [".PP", paragraph]
        options = _options_section(command, context)
        if options:
            lines += [".PP", "Options:", *options]
    lines += [".SH EXIT STATUS", "0 on success; 1 when an operation fails (or, for verify, "
              "finds damage); 2 for usage errors.", ".SH SEE ALSO", "README.md in the dcpctl "
              "source tree."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    click.echo(render_manpage(), nl=False)
