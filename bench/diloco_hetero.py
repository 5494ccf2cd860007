"""Heterogeneous learners: seeded per-learner speed factors (the demo's 1x, 1x, 0.5x,
0.25x), slow all the time, not only under jitter.

Runs the DiLoCo reference run (learners as threads, the demo's size) with and without
the speed factors, without faults and under the demo's chaos, same seeds, and prints for
each: goodput (learner-steps counted, as the demo's report counts them) with the lost
learner-steps by cause, how many merges took a straggler late within the grace window
and how many went on without one, the final validation loss as a ratio to the equal-speed
run of the same schedule, and the wall time.

Usage: python bench/diloco_hetero.py [--quick] [--speeds 1,1,0.5,0.25] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from runs.diloco import record  # noqa: E402
from runs.diloco.demo import demo_config  # noqa: E402
from runs.diloco.report import goodput_accounting  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--speeds", default="1,1,0.5,0.25")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="diloco-hetero-"))
    speeds = tuple(float(x) for x in args.speeds.split(","))
    base = demo_config(quick=args.quick, transport="threads").with_(snapshot_every=0)
    print(f"speed factors {speeds} dealt as {[base.with_(speeds=speeds).speed_of(i) for i in range(base.learners)]}")
    print(f"{'schedule':<9} {'speeds':<10} {'goodput':>8} {'lost by cause':<58} {'late':>4} {'without':>7} "
          f"{'val loss':>8} {'vs equal':>8} {'wall s':>7}")
    for chaos in (False, True):
        ref = None
        for sp in ((), speeds):
            cfg = base.with_(chaos=chaos, speeds=sp)
            res = record(out / f"{'chaos' if chaos else 'nofault'}-{'het' if sp else 'eq'}.tape", cfg)
            acc = goodput_accounting(cfg, res.schedule, res.syncer)
            val = res.syncer.val[-1][1]
            ref = val if ref is None else ref
            slow = {f"learner-{i}" for i in range(cfg.learners) if cfg.speed_of(i) < 1.0}
            late = sum(1 for p in res.syncer.plans if slow & set(p.get("stragglers", ())))
            without = sum(1 for p in res.syncer.plans if slow - set(p["members"]))
            lost = ", ".join(f"{k} {v:g}" for k, v in acc.lost.items() if v)
            print(f"{'chaos' if chaos else 'no faults':<9} {'hetero' if sp else 'equal':<10} {acc.goodput:>7.1%} "
                  f"{lost or '-':<58} {late:>4} {without:>7} {val:>8.4f} {val / ref:>7.3f}x {res.wall_s:>7.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
