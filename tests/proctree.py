"""The processes under one process, read from /proc (no psutil in the test set-up)."""

from __future__ import annotations

import os

__all__ = ["tree"]


def tree(root: int) -> list[int]:
    """``root`` and every process descended from it now, parents before their children.
    Take it before anything dies: an orphan is reparented and no longer found here."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        q = todo.pop(0)
        out.append(q)
        todo += children.get(q, [])
    return out
