"""The ``ckpt`` command line. Importing this package must stay light: no torch."""

from __future__ import annotations

__all__ = ["main"]


def main() -> None:  # thin shim so ``ckpt_cli.main`` works as both module and function name
    from ckpt_cli.main import main as _main

    _main()
