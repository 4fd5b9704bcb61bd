"""man/dcpctl.1 is generated from the click commands and must not drift from them."""

import click
from conftest import REPO_ROOT

from dcpctl.cli.main import cli
from dcpctl.cli.manpage import render_manpage


def test_manpage_is_in_sync_with_the_commands():
    shipped = (REPO_ROOT / "man" / "dcpctl.1").read_text()
    assert shipped == render_manpage(), (
        "man/dcpctl.1 is stale: run `python -m dcpctl.cli.manpage > man/dcpctl.1`")


def test_manpage_covers_every_command_and_option():
    page = render_manpage()
    context = click.Context(cli, info_name="dcpctl")
    for name in cli.list_commands(context):
        command = cli.get_command(context, name)
        assert f".SS dcpctl {name}" in page
        for parameter in command.params:
            for option in getattr(parameter, "opts", []):
                if option.startswith("-"):
                    assert option.replace("-", "\\-") in page, (name, option)
