"""Helpers shared by the checkpoint commands (no torch)."""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any, Callable, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def dump_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=_json_default))


def _json_default(o: Any) -> Any:
    if isinstance(o, bytes):
        return o.hex()
    if isinstance(o, (set, tuple)):
        return list(o)
    return repr(o)


def handle_errors(fn: F) -> F:
    """Turn our documented exceptions into one stderr line and the mapped exit code."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from ckpt.errors import CkptError

        try:
            return fn(*args, **kwargs)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort, BrokenPipeError):
            raise  # click's own exits carry their code already; cli.main handles a closed pipe
        except (CkptError, OSError) as e:
            from ckpt_cli.main import fail

            raise fail(e) from None
        except Exception as e:  # replay errors share the exit_code attribute
            if hasattr(e, "exit_code"):
                from ckpt_cli.main import fail

                raise fail(e) from None
            raise

    return wrapper  # type: ignore[return-value]


def classify(entry_type: str, tensors: int | None = None, name: str = "") -> str:
    """Which of the seven fields a top-level state entry belongs to, by its type.

    Messages an actor holds (a snapshot's recorded channel states, the reserved entry
    ``replay.channels``, or an entry whose type names messages) are "messages", and a
    plain tree without a single tensor (counters, a loop position) is "other": neither
    is weights."""
    t = entry_type.lower()
    if name == "replay.channels" or t.endswith("messages"):
        return "messages"
    if t == "tree" and tensors == 0:
        return "other"
    if "lr_scheduler" in t or "scheduler" in t:
        return "scheduler"
    if "gradscaler" in t:
        return "scaler"
    if ".optim" in t or "optimizer" in t:
        return "optimizer"
    return "weights"


# -- paths -----------------------------------------------------------------------------
def not_found(path: str, what: str = "no such file or directory") -> "click.exceptions.Exit":
    click.echo(f"error: {what} ({path})", err=True)
    return click.exceptions.Exit(5)


def wrong_kind(message: str) -> "click.exceptions.Exit":
    """A path of another kind than the command reads (exit 7, spec/cli.md §2)."""
    click.echo(f"error: {message}", err=True)
    return click.exceptions.Exit(7)


def expect_tape(path: str) -> str:
    """A tape argument: missing is exit 5, a checkpoint or other directory exit 7 (named).
    A file is left to the tape reader, which says precisely what is wrong with it."""
    from ckpt.probe import probe_path

    found = probe_path(path)
    if found.kind == "missing":
        raise not_found(path)
    if found.kind in ("tape", "file"):
        return path
    if found.kind == "checkpoint":
        raise wrong_kind(f"not a tape: {path} is a checkpoint: read it with `ckpt inspect {path}`")
    if found.kind == "run":
        raise wrong_kind(f"not a tape: {path} is {found.what}: `ckpt ls {path}` lists it")
    raise wrong_kind(f"not a tape: {path} is {found.describe()}")


class TapePath(click.Path):
    """A tape argument (file or segment directory): completes like a path; checked by
    :func:`expect_tape` (missing exit 5, a directory of another kind exit 7)."""

    name = "tape"

    def __init__(self) -> None:
        super().__init__(path_type=str)

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        # Click converts parameters before the command's handle_errors runs: a path the
        # OS cannot resolve (a symlink loop, a name too long), a URL no backend serves or
        # a store that fails must become the same one line and exit code here.
        from ckpt.errors import CkptError

        try:
            return expect_tape(super().convert(value, param, ctx))
        except (CkptError, OSError) as e:
            from ckpt_cli.main import fail

            raise fail(e) from None


#: a path argument with no existence check: the library names what is wrong (exit 5 / 7)
ANY_PATH = click.Path(path_type=str)


def refuse_nonempty(path: str, what: str, how: str) -> None:
    """A destination must be new or empty: usage error (exit 2) naming the way out."""
    import os

    if os.path.isdir(path) and os.listdir(path):
        raise click.UsageError(f"{what} {path} is not empty ({how})")
    if os.path.exists(path) and not os.path.isdir(path):
        raise click.UsageError(f"{what} {path} is a file")


# -- progress --------------------------------------------------------------------------
def progress_enabled() -> bool:
    """Bars go to stderr, only when it is a terminal; ``CKPT_PROGRESS=0`` or ``1`` forces it."""
    import sys

    from ckpt.knobs import progress_forced

    forced = progress_forced()
    return sys.stderr.isatty() if forced is None else forced


class Progress:
    """A click progress bar on stderr, or nothing: ``with Progress(label, total) as bar: bar(n)``.

    click's own bar (no extra import: ``ckpt --help`` stays as fast as click). When stderr
    is not a terminal it draws nothing at all, so logs and pipes stay clean."""

    def __init__(self, label: str, total: int, *, enabled: bool | None = None) -> None:
        self.label, self.total = label, total
        self.enabled = progress_enabled() if enabled is None else enabled
        self._bar: Any = None

    def __enter__(self) -> "Progress":
        if self.enabled and self.total > 0:
            import sys

            self._bar = click.progressbar(length=self.total, label=self.label, file=sys.stderr)
            self._bar.__enter__()
        return self

    def __call__(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def to(self, done: int, total: int | None = None) -> None:
        """Absolute position (callbacks that report ``done of total``)."""
        if self._bar is None:
            return
        if total and total != self._bar.length:
            self._bar.length = total
        self._bar.update(max(0, done - self._bar.pos))

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None


def json_option(shape: str, *, lines: bool = False) -> Callable[[F], F]:
    """``--json``, with help naming its documented shape (spec/cli.md §4)."""
    what = "one JSON object per line (JSON Lines)" if lines else "the report as one JSON document"
    return click.option("--json", "as_json", is_flag=True,
                        help=f"Print {what} on stdout; shape and stability: spec/cli.md {shape}.")
