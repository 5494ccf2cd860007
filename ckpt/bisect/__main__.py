"""``python -m ckpt.bisect capsule|trace ...``: the two steps ``ckpt bisect run`` runs in each
environment. Plain argparse, no click: the other environment (another venv, another
machine) needs torch and this package's small dependencies only."""

from __future__ import annotations

import argparse
import sys


def _settings(threads: int | None, deterministic: bool) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ckpt.bisect")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capsule", help="restore a checkpoint, run up to STEP-1, write STEP's capsule")
    c.add_argument("checkpoint", help="a checkpoint, or 'start': the target as built (step 0)")
    c.add_argument("--entry", required=True)
    c.add_argument("--step", type=int)
    c.add_argument("--out", required=True)
    t = sub.add_parser("trace", help="run a capsule's step with every operation digested")
    t.add_argument("capsule")
    t.add_argument("--entry", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--digests-only", action="store_true")
    for p in (c, t):
        p.add_argument("--threads", type=int)
        p.add_argument("--deterministic", action="store_true")
    a = ap.parse_args(argv)
    _settings(a.threads, a.deterministic)
    from . import load_target, make_capsule, save_trace, trace_capsule

    target = load_target(a.entry)
    if a.cmd == "capsule":
        got = make_capsule(None if a.checkpoint == "start" else a.checkpoint, target, a.out, step=a.step)
        print(f"capsule of step {got.step}: {a.out}")
    else:
        trace = trace_capsule(a.capsule, target, keep_tensors=not a.digests_only)
        save_trace(trace, a.out)
        print(f"trace of step {trace.meta.get('step')}: {len(trace.entries)} operations -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
