"""What is at a path: a checkpoint, a run directory, or something else, named.

``ckpt inspect nope``, ``ckpt verify RUN_DIR`` or ``ckpt ls`` of a DCP checkpoint used
to answer "no MANIFEST: the save never committed" for anything that was not a
committed checkpoint. :func:`probe_path` looks (a ``stat``, one directory listing, a
few magic bytes; never a file's content beyond that) and says what the path holds,
with the command that reads it. The reader raises :class:`~ckpt.errors.NotACheckpointError`
from it, and the CLI maps every kind to one exit code (spec/cli.md §2). No torch.

Kinds (``PathKind.kind``):

============  =========================================================================
checkpoint    a directory with a MANIFEST (committed; whether it verifies is another matter)
temporary     a save in progress or one that crashed (name starts with ``.tmp-``)
incomplete    a directory without MANIFEST that holds a save's files (one that never
              committed), or nothing at all
dir           any other directory: no MANIFEST, no checkpoint files, none of the below
run           a run directory: subdirectories that are checkpoints (or run directories)
ledger        a step ledger (``NNNNN.tape`` files, ``ckpt.ledger``)
tape          an event tape: a file starting with the tape magic, or a segment directory
dcp           a torch.distributed.checkpoint directory (``.metadata`` + ``*.distcp``)
hf            a Hugging Face model directory (``config.json``, ``model.safetensors`` ...)
hf-trainer    a Hugging Face Trainer checkpoint (``trainer_state.json``)
file          any other regular file (a checkpoint is a directory)
missing       nothing at that path
============  =========================================================================
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from typing import Any

from .format.manifest import MANIFEST_NAME, TMP_PREFIX

__all__ = ["PathKind", "probe_path", "backend", "list_dir", "KINDS", "FOREIGN_KINDS"]

KINDS = ("checkpoint", "temporary", "incomplete", "run", "ledger", "tape", "dcp", "hf", "hf-trainer", "dir", "file",
         "missing")
#: kinds that are a directory or file of another format or role: never "incomplete"
FOREIGN_KINDS = ("run", "ledger", "tape", "dcp", "hf", "hf-trainer", "dir", "file")
#: file names a save writes into a checkpoint directory (spec/checkpoint-format.md §3)
_PART_FILE = re.compile(r"\.(state\.msgpack\.zst|safetensors)$")

_TAPE_MAGIC = b"CKPTTAPE"
_LEDGER_NAME = re.compile(r"^\d{5,}\.tape$")
_SEGMENT_NAME = re.compile(r"^\d{8}\.seg$")
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
#: a listing longer than this is not scanned further (a huge directory is not a checkpoint anyway)
_MAX_NAMES = 100_000


@dataclass(frozen=True, slots=True)
class PathKind:
    """What :func:`probe_path` found. ``what`` is one line for a person; ``hint`` the
    command that reads it (or None); ``checkpoints``: a run directory's committed
    checkpoints, by name, oldest step first."""

    kind: str
    path: str
    what: str
    hint: str | None = None
    checkpoints: tuple[str, ...] = ()

    def describe(self) -> str:
        """``what`` and ``hint`` as one sentence, for an error message."""
        return self.what + (f": {self.hint}" if self.hint else "")


class _Local:
    """The filesystem as the probe sees it: ``stat`` follows symlinks (a link to a
    checkpoint is a checkpoint)."""

    def stat(self, p: str) -> os.stat_result:
        return os.stat(p)

    def names(self, p: str) -> list[str]:
        out = []
        with os.scandir(p) as it:
            for e in it:
                out.append(e.name)
                if len(out) >= _MAX_NAMES:
                    break
        return out

    def head(self, p: str) -> bytes:
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            return b""
        try:
            return os.pread(fd, 8, 0)
        except OSError:
            return b""
        finally:
            os.close(fd)


class _Through:
    """Any ``ckpt.storage`` backend (an object store: prefixes stand for directories)."""

    def __init__(self, storage: Any) -> None:
        self.s = storage

    def stat(self, p: str) -> os.stat_result:
        return self.s.lstat(p)

    def names(self, p: str) -> list[str]:
        return list(self.s.listdir(p))[:_MAX_NAMES]

    def head(self, p: str) -> bytes:
        try:
            return bytes(self.s.read(p, 0, 8))
        except (OSError, ValueError):
            return b""


def _is_dir(fs: Any, p: str) -> bool:
    try:
        return stat.S_ISDIR(fs.stat(p).st_mode)
    except OSError:
        return False


def _is_file(fs: Any, p: str) -> bool:
    try:
        return stat.S_ISREG(fs.stat(p).st_mode)
    except OSError:
        return False


def _file_kind(fs: Any, path: str) -> PathKind:
    head = fs.head(path)
    if head == _TAPE_MAGIC:
        return PathKind("tape", path, "an event tape (a file)", f"read it with `ckpt tape show {path}` or `ckpt tape verify {path}`")
    name = os.path.basename(path)
    if name == MANIFEST_NAME:
        parent = os.path.dirname(path) or "."
        return PathKind("file", path, "a checkpoint's MANIFEST file", f"name the checkpoint directory: {parent}")
    what = "a file, and a checkpoint is a directory (holding MANIFEST)"
    if name.endswith(".safetensors"):
        what = "a safetensors file, and a checkpoint is a directory (holding MANIFEST)"
    elif head.startswith(b"PK\x03\x04"):
        what = "a zip archive (torch.save writes these), and a checkpoint is a directory (holding MANIFEST)"
    return PathKind("file", path, what)


def _steps_first(names: list[str]) -> list[str]:
    def key(n: str) -> tuple[int, int, str]:
        m = re.search(r"(\d+)$", n)
        return (0, int(m.group(1)), n) if m else (1, 0, n)

    return sorted(names, key=key)


def backend(path: str | os.PathLike[str], storage: Any = None) -> tuple[Any, str]:
    """``(storage, path)``: the backend that serves ``path`` (None: the local filesystem, the
    path as typed), through ``ckpt.storage.resolve`` where there is one (URLs)."""
    p = os.fspath(path)
    from .storage import local, resolve

    if storage is not None:
        return (None, p) if storage is local else (storage, p)
    got, norm = resolve(p)
    return (None, p) if got is local else (got, norm)


def _fs(storage: Any) -> Any:
    return _Local() if storage is None else _Through(storage)


def list_dir(path: str, storage: Any = None) -> list[tuple[str, bool]]:
    """``(name, is a directory)`` of the entries of a directory, through ``backend()``."""
    st, p = backend(path, storage)
    fs = _fs(st)
    return [(n, _is_dir(fs, os.path.join(p, n))) for n in sorted(fs.names(p))]


def probe_path(path: str | os.PathLike[str], *, storage: Any = None) -> PathKind:
    """Say what ``path`` holds (see the module docstring for the kinds). ``storage``: the
    backend that serves ``path`` (default: the one ``ckpt.storage`` resolves it to)."""
    st_, p = backend(path, storage)
    fs: Any = _fs(st_)
    try:
        st = fs.stat(p)
    except FileNotFoundError:
        return PathKind("missing", p, "no such file or directory")
    except NotADirectoryError:
        return PathKind("missing", p, "no such file or directory (a parent is a file)")
    if not stat.S_ISDIR(st.st_mode):
        if stat.S_ISREG(st.st_mode):
            return _file_kind(fs, p)
        return PathKind("file", p, "not a regular file or directory (a device, socket or pipe)")
    real = os.path.realpath(p) if isinstance(fs, _Local) else p
    if os.path.basename(real.rstrip("/")).startswith(TMP_PREFIX):
        return PathKind("temporary", p, "the temporary directory of a save in progress, or of one that crashed")
    if _is_file(fs, os.path.join(p, MANIFEST_NAME)):
        return PathKind("checkpoint", p, "a checkpoint")
    try:
        names = fs.names(p)
    except OSError as e:
        return PathKind("incomplete", p, f"a directory that cannot be listed ({e.strerror or e})")
    have = set(names)
    if ".metadata" in have:
        return PathKind("dcp", p, "a DCP checkpoint (torch.distributed.checkpoint: .metadata and .distcp files)",
                        f"convert it with `ckpt import dcp {p} DST`")
    if "trainer_state.json" in have:
        return PathKind("hf-trainer", p, "a Hugging Face Trainer checkpoint (trainer_state.json)",
                        "Trainer resumes from it; ckpt.integrations.hf.CkptTrainer writes checkpoints of ours")
    if any(n in have for n in _HF_WEIGHTS):
        return PathKind("hf", p, "a Hugging Face model directory (config.json, model weights)",
                        "load it with transformers' from_pretrained; `ckpt export hf CKPT DIR` writes these")
    ledger = [n for n in names if _LEDGER_NAME.match(n)]
    if ledger:
        first = os.path.join(p, sorted(ledger)[0])
        return PathKind("ledger", p, f"a step ledger ({len(ledger)} tape(s))", f"read it with `ckpt tape show {first}`")
    segments = [n for n in names if _SEGMENT_NAME.match(n)]
    if segments and any(fs.head(os.path.join(p, n)) == _TAPE_MAGIC for n in segments[:4]):
        return PathKind("tape", p, "an event tape (a segment directory)", f"read it with `ckpt tape show {p}`")
    ckpts, nested = [], 0
    for n in names:
        child = os.path.join(p, n)
        if n.startswith(TMP_PREFIX) or not _is_dir(fs, child):
            continue
        if _is_file(fs, os.path.join(child, MANIFEST_NAME)):
            ckpts.append(n)
        elif _holds_checkpoints(fs, child):
            nested += 1
    if ckpts or nested:
        ordered = tuple(_steps_first(ckpts))
        newest = f", newest {ordered[-1]}" if ordered else ""
        hint = f"`ckpt ls {p}` lists them"
        if ordered:
            hint += f"; name one of them (`ckpt inspect {os.path.join(p, ordered[-1])}`, or `ckpt inspect --latest {p}`)"
        what = f"a run directory ({len(ordered)} checkpoint(s){newest}" + (f", {nested} nested run dir(s)" if nested else "") + ")"
        return PathKind("run", p, what, hint, ordered)
    if not names:
        return PathKind("incomplete", p, "an empty directory (no MANIFEST: not a committed checkpoint)")
    if any(_PART_FILE.search(n) for n in names):
        return PathKind("incomplete", p, "no MANIFEST: the save never committed")
    return PathKind("dir", p, "a directory that holds no checkpoint (no MANIFEST, no checkpoint files, no checkpoints in it)")


def _holds_checkpoints(fs: Any, path: str) -> bool:
    try:
        for i, n in enumerate(fs.names(path)):
            if i >= 10_000:
                return False
            if _is_file(fs, os.path.join(path, n, MANIFEST_NAME)):
                return True
    except OSError:
        return False
    return False
