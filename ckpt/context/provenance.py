"""Commit SHA of the training code, a dirty flag and the hash of the uncommitted diff.

Looked up once per process and code directory: the code of a running job does not
change under it, and ``git`` costs tens of milliseconds we do not want on every save.

**Never a subprocess on a background thread.** Starting ``git`` creates pipes; a
DataLoader worker forked by the training thread meanwhile inherits their write ends
(``fork`` ignores ``O_CLOEXEC``), so the starting thread waits in
``subprocess._execute_child`` until that worker exits, and the worker lives until the
training thread, itself waiting for the save, ends its epoch: a deadlock. ``git`` runs
therefore only on the main thread or through :func:`prime` (which the manager calls on
the thread that constructs it and that forks the DataLoader's workers, so no fork can
race it). A background thread that finds nothing cached reads the commit from the
``.git`` files themselves (HEAD, loose refs, packed-refs): no process, but no dirty
flag either, which it says in ``reason``.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import threading
from typing import Any

__all__ = ["capture_commit", "default_code_dir", "prime", "read_head"]

_SHA_RE = re.compile(rb"[0-9a-f]{40}(?:[0-9a-f]{24})?")  # SHA-1 or SHA-256 object names
_MAX_REF_BYTES = 1 << 16  # HEAD and a loose ref are one line; a packed-refs line is bounded too
_MAX_PACKED_REFS = 64 << 20
_MAX_SYMREF_HOPS = 5

_cache: dict[str, dict[str, Any]] = {}
_cache_lock = threading.Lock()  # held only around dict access, never across a git run


def _after_fork_in_child() -> None:
    global _cache_lock
    _cache_lock = threading.Lock()  # a thread holding it at the fork does not exist in the child


os.register_at_fork(after_in_child=_after_fork_in_child)


def default_code_dir() -> str:
    main = sys.modules.get("__main__")
    f = getattr(main, "__file__", None)
    return os.path.dirname(os.path.abspath(f)) if f else os.getcwd()


def _git(args: list[str], cwd: str) -> bytes:
    # git gets this process's environment as is (not read here: passed on, spec/knobs.md),
    # plus GIT_OPTIONAL_LOCKS so a status never takes the index lock.
    # close_fds (the default) keeps our other descriptors (locks, open checkpoint files)
    # out of git; stdin is /dev/null so git never waits on the terminal.
    return subprocess.run(
        ["git", *args], cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, check=True, timeout=20,
        close_fds=True, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},
    ).stdout


def _with_git(cwd: str) -> dict[str, Any]:
    try:
        sha = _git(["rev-parse", "HEAD"], cwd).decode().strip()
        top = _git(["rev-parse", "--show-toplevel"], cwd).decode().strip()
        status = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
        dirty = bool(status.strip())
        diff_hash = hashlib.sha256(_git(["diff", "HEAD", "--binary"], cwd)).hexdigest() if dirty else None
        return {"available": True, "sha": sha, "dirty": dirty, "diff_sha256": diff_hash, "repo": top, "reason": None}
    except FileNotFoundError:
        reason = "git is not installed"
    except subprocess.CalledProcessError as e:
        msg = e.stderr.decode(errors="replace").strip().splitlines()
        reason = f"not a git checkout: {msg[-1] if msg else 'git failed'}"
    except subprocess.TimeoutExpired:
        reason = "git timed out"
    return _unavailable(reason)


def _unavailable(reason: str) -> dict[str, Any]:
    return {"available": False, "sha": None, "dirty": None, "diff_sha256": None, "repo": None, "reason": reason}


def _read_small(path: str, limit: int = _MAX_REF_BYTES) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def _find_git_dir(start: str) -> tuple[str, str] | None:
    """(work tree top, git dir) of the checkout holding ``start``, as git discovers it:
    the nearest ancestor with a ``.git`` directory, or a ``.git`` file naming the git dir
    (a linked worktree, a submodule)."""
    d = os.path.realpath(start)
    while True:
        dot = os.path.join(d, ".git")
        if os.path.isdir(dot):
            return d, dot
        if os.path.isfile(dot):
            raw = _read_small(dot) or b""
            if raw.startswith(b"gitdir:"):
                target = raw[len(b"gitdir:"):].strip().decode("utf-8", "surrogateescape")
                return d, os.path.normpath(os.path.join(d, target))
            return None
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def _packed_ref(common: str, ref: bytes) -> bytes | None:
    raw = _read_small(os.path.join(common, "packed-refs"), _MAX_PACKED_REFS)
    if raw is None:
        return None
    for line in raw.splitlines():
        if line.startswith((b"#", b"^")):
            continue
        sha, _, name = line.partition(b" ")
        if name.strip() == ref:
            return sha
    return None


def read_head(code_dir: str) -> tuple[str, str] | None:
    """(commit SHA of HEAD, work tree top) read from the ``.git`` files, without running
    ``git``; None where that is not possible (no checkout, a reftable repository, a
    symbolic ref that leads nowhere). Safe on any thread: it opens, reads and closes
    files and starts no process."""
    found = _find_git_dir(code_dir)
    if found is None:
        return None
    top, git_dir = found
    common_rel = _read_small(os.path.join(git_dir, "commondir"))
    common = os.path.normpath(os.path.join(git_dir, common_rel.strip().decode("utf-8", "surrogateescape"))) \
        if common_rel else git_dir
    value = _read_small(os.path.join(git_dir, "HEAD"))
    for _ in range(_MAX_SYMREF_HOPS):
        if value is None:
            return None
        value = value.strip()
        if not value.startswith(b"ref:"):
            break
        ref = value[4:].strip()
        if b".." in ref or not ref.startswith(b"refs/"):
            return None
        name = ref.decode("utf-8", "surrogateescape")
        # Per-worktree refs live in the worktree's git dir, shared ones in the common dir.
        value = _read_small(os.path.join(git_dir, name)) or _read_small(os.path.join(common, name)) \
            or _packed_ref(common, ref)
    if value is None or not _SHA_RE.fullmatch(value.strip()):
        return None
    return value.strip().decode(), top


def _without_git(cwd: str) -> dict[str, Any]:
    head = read_head(cwd)
    if head is None:
        return _unavailable("commit not captured: first asked on a background thread, where git is not run, "
                            "and the .git files do not name a commit")
    sha, top = head
    return {"available": True, "sha": sha, "dirty": None, "diff_sha256": None, "repo": top,
            "reason": "dirty state not captured: first asked on a background thread, where git is not run"}


def _key(code_dir: str | None) -> str:
    return os.path.abspath(code_dir or default_code_dir())


def prime(code_dir: str | None = None) -> dict[str, Any]:
    """Capture the commit now, on the calling thread, running ``git`` if not yet done for
    ``code_dir``. Call it on the thread that forks worker processes (the training loop's),
    before a background save asks: the saves then find it cached."""
    key = _key(code_dir)
    with _cache_lock:
        got = _cache.get(key)
    if got is None:
        got = _with_git(key)
        with _cache_lock:
            got = _cache.setdefault(key, got)
    return dict(got)


def capture_commit(code_dir: str | None = None) -> dict[str, Any]:
    """The commit of ``code_dir`` (default: the directory of ``__main__``'s file): cached
    per process; on a miss, ``git`` runs on the main thread only, any other thread reads
    the ``.git`` files (no dirty flag) without caching what it read."""
    key = _key(code_dir)
    with _cache_lock:
        got = _cache.get(key)
    if got is not None:
        return dict(got)
    if threading.current_thread() is threading.main_thread():
        return prime(key)
    return _without_git(key)
