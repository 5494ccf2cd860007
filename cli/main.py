"""Root ``ckpt`` group: lazy subcommands and the one place errors become exit codes.

Exit codes (one table for every command and every kind of bad path: spec/cli.md §2):

====  ==========================================================================
0     success: valid, identical, no violation
1     unexpected error; a demo check failed; an attempt crashed (check-resume)
2     usage error: bad option, a destination that is not empty, an entry that
      does not exist, a tape not trusted (replay), no claim (check-resume --)
3     corrupt: a format or integrity error (file, chunk, byte range named)
4     incomplete: not a committed checkpoint (no MANIFEST, a temporary dir), a
      torn or unclosed tape
5     not found: no such path, or removed while being read
6     different: ``diff`` found differences, ``replay`` diverged, ``tape check``
      found violations, strict environment gate refused
7     not a checkpoint: a file, a run directory, a step ledger, a tape, a DCP or
      a Hugging Face directory where a checkpoint (or tape) was expected; the
      message names what it is and the command that reads it
8     ``diff``: the training state is identical, only the config (or commit,
      topology, environment) differs
====  ==========================================================================

Several paths (``verify``): the smallest non-zero code of the outcomes.

Subcommands live in their own modules and are imported only when invoked, so that
``ckpt --help`` and ``ckpt inspect`` never import torch (a test enforces this).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

__all__ = ["main", "cli", "EXIT_OK", "EXIT_CORRUPT", "EXIT_INCOMPLETE", "EXIT_NOT_FOUND", "EXIT_DIFFERENT",
           "EXIT_NOT_A_CHECKPOINT"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3
EXIT_INCOMPLETE = 4
EXIT_NOT_FOUND = 5
EXIT_DIFFERENT = 6
EXIT_NOT_A_CHECKPOINT = 7

# name -> (module:attr, one-line help). The help is duplicated here on purpose: listing
# commands must not import their modules.
_COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("ckpt_cli.inspect_cmd:inspect_cmd", "Summarise a checkpoint: the seven fields, tensors, provenance."),
    "verify": ("ckpt_cli.verify_cmd:verify_cmd", "Re-hash every chunk of checkpoints and run directories (--quick: structure)."),
    "diff": ("ckpt_cli.diff_cmd:diff_cmd", "Compare two checkpoints: tensors, config, commit, topology, RNG, env."),
    "ls": ("ckpt_cli.ls_cmd:ls_cmd", "List the checkpoints of a run directory with their status."),
    "demo": ("ckpt_cli.demo_cmd:demo_cmd", "Run the demo training job and report on it."),
    "tape": ("ckpt_cli.tape_cmd:tape", "Show, verify, check, merge, diff and repair event tapes."),
    "replay": ("ckpt_cli.tape_cmd:replay_cmd", "Re-execute a recorded run and prove it bit-identical."),
    "check-resume": ("ckpt_cli.resume_cmd:check_resume_cmd", "Kill and resume a training entry point; compare bits."),
    "import": ("ckpt_cli.dcp_cmd:import_group", "Convert another format into a checkpoint (import dcp SRC DST)."),
    "export": ("ckpt_cli.dcp_cmd:export_group", "Convert a checkpoint into another format (export dcp|hf SRC DST)."),
    "ledger": ("ckpt_cli.bisect_cmd:ledger_group", "Compare two runs' step ledgers: the first differing step (ledger diff)."),
    "bisect": ("ckpt_cli.bisect_cmd:bisect_group", "Name the first operation (module, phase) where two runs differ."),
    "check-determinism": ("ckpt_cli.bisect_cmd:check_determinism_cmd", "Run a script twice; the first nondeterministic step, operation and fix."),
    "completion": ("ckpt_cli.completion_cmd:completion_cmd", "Print the shell completion script (bash, zsh, fish)."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        spec = _COMMANDS.get(name)
        if spec is None:
            return None
        mod_name, attr = spec[0].split(":")
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:  # a command whose module is not built yet
            if e.name == mod_name:
                return None
            raise
        return getattr(mod, attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, _COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


_EPILOG = ("Exit codes: 0 ok, 1 error, 2 usage, 3 corrupt, 4 incomplete, 5 not found, 6 different, "
           "7 not a checkpoint (spec/cli.md). Every command that prints a report takes --json. "
           "Shell completion: eval \"$(ckpt completion bash)\" (or zsh, fish).")


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]}, epilog=_EPILOG)
@click.version_option(package_name="ckpt-replay", prog_name="ckpt")
def cli() -> None:
    """ckpt: exact, verifiable checkpoints and replayable event tapes for PyTorch."""


def exit_code_for(exc: BaseException) -> int:
    """Map an exception to the documented exit code (one place, as click does)."""
    code = getattr(exc, "exit_code", None)
    if isinstance(code, int):
        return code
    if isinstance(exc, FileNotFoundError):
        return EXIT_NOT_FOUND
    return EXIT_ERROR


def main(argv: list[str] | None = None) -> Any:
    try:
        return cli.main(args=argv, prog_name="ckpt", standalone_mode=True)
    except BrokenPipeError:
        # `ckpt tape show T | head`: the reader left; stop quietly, as Unix tools do.
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)


def fail(exc: BaseException) -> "click.exceptions.Exit":
    """Print ``exc`` as one clear line on stderr and return the Exit to raise."""
    click.echo(f"error: {exc}", err=True)
    return click.exceptions.Exit(exit_code_for(exc))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
