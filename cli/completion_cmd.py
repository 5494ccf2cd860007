"""``ckpt completion bash|zsh|fish``: print the shell completion script (click's own).

The same script click generates from ``_CKPT_COMPLETE=bash_source ckpt``; printed by a
command so that it can be installed in one line (docs/cli.md, "Shell completion")."""

from __future__ import annotations

import click

SHELLS = ("bash", "zsh", "fish")


@click.command("completion")
@click.argument("shell", type=click.Choice(SHELLS))
def completion_cmd(shell: str) -> None:
    """Print the completion script for SHELL.

    \b
    bash:  eval "$(ckpt completion bash)"          (in ~/.bashrc)
    zsh:   eval "$(ckpt completion zsh)"           (in ~/.zshrc)
    fish:  ckpt completion fish > ~/.config/fish/completions/ckpt.fish
    """
    from click.shell_completion import get_completion_class

    from ckpt_cli.main import cli

    cls = get_completion_class(shell)
    assert cls is not None  # every name in SHELLS is one of click's
    click.echo(cls(cli, {}, "ckpt", "_CKPT_COMPLETE").source())
