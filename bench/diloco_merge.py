"""Standard averaging vs radial-directional averaging (RDA) of the outer gradients.

Runs the DiLoCo reference run (learners as threads) four times with the same seeds:
{no faults, seeded chaos} x {merge="mean", merge="rda"}, and prints each run's final
validation loss and its ratio to the standard-averaging run of the same schedule. The
runs are short (the demo's quick size unless --full), so read the ratios as this scale's
answer, not the paper's.

Usage: python bench/diloco_merge.py [--full] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from runs.diloco import record  # noqa: E402
from runs.diloco.demo import demo_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the demo's full size instead of the quick one")
    ap.add_argument("--out", default=None, help="where the tapes go (default: a temporary directory)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="diloco-merge-"))
    base = demo_config(quick=not args.full, transport="threads").with_(snapshot_every=0)
    rows = []
    for chaos in (False, True):
        ref = None
        for merge in ("mean", "rda"):
            cfg = base.with_(chaos=chaos, merge=merge)
            res = record(out / f"{'chaos' if chaos else 'nofault'}-{merge}.tape", cfg)
            val = res.syncer.val[-1][1]
            ref = val if ref is None else ref
            rows.append((("chaos" if chaos else "no faults"), merge, val, val / ref))
    print(f"{'schedule':<10} {'merge':<5} {'final val loss':>14} {'vs mean':>8}")
    for sched, merge, val, ratio in rows:
        print(f"{sched:<10} {merge:<5} {val:>14.4f} {ratio:>7.3f}x")


if __name__ == "__main__":
    main()
