"""Verify many checkpoints at once: paths, run directories (recursively), one verdict each.

``ckpt verify PATH...`` is a thin rendering of :func:`verify_paths`. A run directory
stands for every checkpoint in it (nested run directories included); temporary
directories, step ledgers, tapes and unrelated directories in it are skipped and said
so; a directory in it that holds a save's files but no MANIFEST is reported incomplete.
A path given by name that is not a checkpoint or run directory is a failure naming what
it is. Every outcome carries the exit code the CLI uses for it (spec/cli.md §2); the
code of a whole run is the smallest non-zero one, so corrupt (3) outranks incomplete
(4), missing (5) and not-a-checkpoint (7). No torch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Iterable

from .errors import CkptError
from .probe import PathKind, backend, list_dir, probe_path

__all__ = ["Outcome", "verify_paths", "overall_exit_code", "STATUSES"]

#: ``Outcome.status`` values, in the JSON too
STATUSES = ("valid", "structure ok", "corrupt", "incomplete", "missing", "not a checkpoint", "skipped", "error")
_STEP_NAME = re.compile(r"^step-\d{8,}$")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One path's verdict. ``exit_code`` 0 for valid, structure ok and skipped."""

    path: str
    status: str
    exit_code: int = 0
    kind: str = "checkpoint"
    step: int | None = None
    files: int = 0
    chunks: int = 0
    bytes: int = 0
    message: str | None = None

    def __repr__(self) -> str:
        extra = f", {self.message!r}" if self.message else ""
        return f"Outcome({self.path!r}, {self.status!r}, exit {self.exit_code}{extra})"


def overall_exit_code(outcomes: Iterable[Outcome]) -> int:
    codes = [o.exit_code for o in outcomes if o.exit_code]
    return min(codes) if codes else 0


def _collect(path: str, found: PathKind, named: bool, out: list[tuple[str, PathKind | Outcome]], depth: int = 0) -> None:
    """Expand run directories into (path, kind) to verify, or outcomes decided already."""
    k = found.kind
    if k == "checkpoint":
        out.append((path, found))
    elif k == "run" and depth < 8:
        for name, is_dir in list_dir(path):
            child = os.path.join(path, name)
            if not is_dir:
                continue  # files beside checkpoints (a tape, a plot) are not checkpoints
            sub = probe_path(child)
            if sub.kind in ("checkpoint", "run") or (sub.kind == "incomplete" and (_STEP_NAME.match(name) or
                                                                                    sub.what.startswith("no MANIFEST"))):
                _collect(child, sub, False, out, depth + 1)
            else:
                out.append((child, Outcome(child, "skipped", 0, sub.kind, message=sub.what)))
    elif k == "missing":
        out.append((path, Outcome(path, "missing", 5, k, message=found.what)))
    elif k == "temporary":
        code = 4 if named else 0
        out.append((path, Outcome(path, "incomplete" if named else "skipped", code, k, message=found.what)))
    elif k == "incomplete":
        out.append((path, Outcome(path, "incomplete", 4, k, message=found.what)))
    else:
        out.append((path, Outcome(path, "not a checkpoint", 7, k, message=found.describe())))


def verify_paths(
    paths: Iterable[str | os.PathLike[str]],
    *,
    quick: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> list[Outcome]:
    """Verify every checkpoint the paths name or hold, in order; never raises a CkptError.

    ``progress(done_bytes, total_bytes)`` is called as chunks are re-hashed (not with
    ``quick``): the total is the sum of the MANIFEST sizes, known before the first byte.
    """
    from .reader import CheckpointReader

    todo: list[tuple[str, PathKind | Outcome]] = []
    for p in paths:
        s = os.fspath(p)
        _collect(s, probe_path(s), True, todo)  # a URL scheme no backend serves: UnsupportedSchemeError (exit 2)
    readers: dict[str, CheckpointReader | Outcome] = {}
    for path, what in todo:
        if isinstance(what, PathKind):
            try:
                storage, at = backend(path)
                readers[path] = CheckpointReader(at) if storage is None else CheckpointReader(at, storage=storage)
            except CkptError as e:
                readers[path] = _failed(path, e)
    total = sum(r.manifest.total_bytes for r in readers.values() if isinstance(r, CheckpointReader))
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    out: list[Outcome] = []
    for path, what in todo:
        if isinstance(what, Outcome):
            out.append(what)
            continue
        r = readers[path]
        if isinstance(r, Outcome):
            out.append(r)
            continue
        try:
            rep = r.verify(quick=quick, progress=None if quick else tick)
        except CkptError as e:
            out.append(_failed(path, e, step=r.step))
            continue
        out.append(Outcome(path, "structure ok" if quick else "valid", 0, "checkpoint", r.step, rep.files, rep.chunks,
                           rep.bytes))
    return out


def _failed(path: str, e: CkptError, *, step: int | None = None) -> Outcome:
    from .errors import CheckpointNotFoundError, IncompleteCheckpointError, NotACheckpointError

    code = e.exit_code
    if isinstance(e, NotACheckpointError):
        status = "not a checkpoint"
    elif isinstance(e, IncompleteCheckpointError):
        status = "incomplete"
    elif isinstance(e, CheckpointNotFoundError):
        status = "missing"
    else:
        status = "corrupt" if code == 3 else "error"
    return Outcome(path, status, code, "checkpoint", step, message=str(e))
