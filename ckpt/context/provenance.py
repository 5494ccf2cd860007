"""Commit SHA of the training code, a dirty flag and the hash of the uncommitted diff.

Looked up once per process and code directory: the code of a running job does not
change under it, and ``git`` costs tens of milliseconds we do not want on every save.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
from typing import Any

__all__ = ["capture_commit", "default_code_dir"]


def default_code_dir() -> str:
    main = sys.modules.get("__main__")
    f = getattr(main, "__file__", None)
    return os.path.dirname(os.path.abspath(f)) if f else os.getcwd()


def _git(args: list[str], cwd: str) -> bytes:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, check=True, timeout=20, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    ).stdout


@functools.lru_cache(maxsize=16)
def capture_commit(code_dir: str | None = None) -> dict[str, Any]:
    cwd = code_dir or default_code_dir()
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
    return {"available": False, "sha": None, "dirty": None, "diff_sha256": None, "repo": None, "reason": reason}
