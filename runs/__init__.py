"""The reference training runs, built only on the public APIs of ``ckpt`` and ``replay``.

``common`` holds what the runs share (the tiny language model and its corpus), ``basic``
the single-process checkpoint / bit-exact resume run, ``diloco`` the Decoupled-DiLoCo
run under chaos. ``ckpt demo NAME`` runs one of them (:data:`DEMOS`).

Each demo is a function named by its entry point, called as
``fn(out_dir, *, quick, echo, progress, options)`` and returning its named checks, a
sequence of ``(name, passed)``. ``options`` holds the command line's demo-specific
values (``transport``, ``steps``, ...); a demo reads the keys it knows. Importing this
package must stay torch-free (``ckpt demo --help`` and ``--list`` are fast), so the
registry holds strings and the CLI imports a demo only to run it.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DEMOS", "Demo"]


class Demo(NamedTuple):
    line: str  # one line for `ckpt demo --list`
    entry: str  # "module:function"


# name -> demo; the first is the default. One line per demo, so additions merge cleanly.
DEMOS: dict[str, Demo] = {
    "diloco": Demo("Decoupled DiLoCo under seeded chaos: no-fault run, synchronous baseline, replay, snapshots",
                   "runs.diloco.demo:main"),
    "stages": Demo("pipeline stage skipping: stages bypassed while offline, peer recovery, SparseLoCo exchanges, replay",
                   "runs.stages.demo:main"),
    "basic": Demo("single process: checkpoint a tiny transformer, inspect, verify, resume bit for bit",
                  "runs.basic.demo:main"),
    "replicas": Demo("replica groups on torchft: SIGKILL, replacement recovers from a live peer, SDC checks, replay",
                     "runs.replicas.demo:main"),
    "rollback": Demo("loss-spike rollback on a tiny MoE: detect, roll back, skip the window, replay the routing",
                     "runs.rollback.demo:main"),
}
