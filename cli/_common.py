"""Helpers shared by the checkpoint commands (no torch)."""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any, Callable, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


class PathOrURL(click.ParamType):
    """A local path (checked like ``click.Path``) or a storage URL (``s3://...``),
    passed through as typed: ``ckpt.storage.resolve`` decides what serves it."""

    name = "path"

    def __init__(self, **path_options: Any) -> None:
        self._path = click.Path(path_type=str, **path_options)

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        import re

        if isinstance(value, str) and re.match(r"^[A-Za-z][A-Za-z0-9+.\-]+://", value) and not value.startswith("file://"):
            return value
        return self._path.convert(value, param, ctx)


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
