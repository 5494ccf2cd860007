"""The reference training runs, built only on the public APIs of ``ckpt`` and ``replay``.

``common`` holds what the runs share (the tiny language model and its corpus), ``basic``
the single-process checkpoint / bit-exact resume run, ``diloco`` the Decoupled-DiLoCo
run under chaos. ``ckpt demo NAME`` runs one of them (:data:`DEMOS`).
"""

from __future__ import annotations

__all__ = ["DEMOS"]

# name -> one line for `ckpt demo --list`; the first is the default
DEMOS: dict[str, str] = {
    "diloco": "Decoupled DiLoCo under seeded chaos: no-fault run, synchronous baseline, replay, snapshots",
    "basic": "single process: checkpoint a tiny transformer, inspect, verify, resume bit for bit",
}
