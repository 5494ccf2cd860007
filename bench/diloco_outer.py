"""Why the no-fault run ended above the chaos run, and the outer optimiser tuned on the
no-fault run (never on the chaos run).

Runs the DiLoCo reference run (learners as threads, the demo's size) without faults over
a grid of outer learning rates and momenta, each with the same seeds, and prints every
final validation loss as a ratio to the synchronous elastic baseline's (same model,
data and inner optimiser, trained in lockstep: the reference a DiLoCo run approaches).
Then, with the outer optimiser that did best without faults, the chaos run. It also
prints the mean norm of the merged outer gradient relative to the mean norm of the
learners' own outer gradients at the same steps (a plain mean of disagreeing directions
is shorter than each of them: the step the outer optimiser takes shrinks as more
learners contribute, which is the no-fault run's handicap).

``--lags`` also varies the staleness bound (``max_lag_rounds``: how many rounds a learner
may run ahead of the merges it has applied), and ``--transport gloo`` runs the learners
as processes, which run further ahead of the syncer than threads of one process do.

Usage: python bench/diloco_outer.py [--quick] [--lrs 0.7,1.0,1.4] [--moms 0.9] [--lags 1] [--transport threads]
       [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from runs.diloco import record  # noqa: E402
from runs.diloco.baseline import run_baseline  # noqa: E402
from runs.diloco.chaos import NO_FAULTS  # noqa: E402
from runs.diloco.demo import demo_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the demo's quick size")
    ap.add_argument("--lrs", default="0.5,0.7,1.0,1.4")
    ap.add_argument("--moms", default="0.9,0.6")
    ap.add_argument("--lags", default=None, help="max_lag_rounds values (default: the config's)")
    ap.add_argument("--transport", default="threads", choices=("threads", "gloo"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="diloco-outer-"))
    base = demo_config(quick=args.quick, transport=args.transport).with_(snapshot_every=0)
    lags = [int(x) for x in args.lags.split(",")] if args.lags else [base.max_lag_rounds]
    sync = run_baseline(base.with_(chaos=False), NO_FAULTS, out / "baseline")
    ref = sync.val[-1][1]
    print(f"synchronous baseline (no faults): final val loss {ref:.4f}")
    print(f"{'lag':>3} {'outer lr':>8} {'momentum':>8} {'no-fault val':>12} {'vs sync':>8} {'|avg|/avg|g|':>12}")
    best = None
    for lag in lags:
        for mom in [float(x) for x in args.moms.split(",")]:
            for lr in [float(x) for x in args.lrs.split(",")]:
                cfg = base.with_(chaos=False, outer_lr=lr, outer_momentum=mom, max_lag_rounds=lag)
                res = record(out / f"nofault-{lag}-{lr}-{mom}.tape", cfg)
                v = res.syncer.val[-1][1]
                sh = [r for n, r in res.syncer.shrink if n > 1]
                ratio = sum(sh) / len(sh) if sh else float("nan")
                print(f"{lag:>3} {lr:>8.2f} {mom:>8.2f} {v:>12.4f} {v / ref:>7.3f}x {ratio:>12.3f}", flush=True)
                if best is None or v < best[0]:
                    best = (v, lr, mom, lag)
    assert best is not None
    v, lr, mom, lag = best
    chaos = record(out / f"chaos-{lr}-{mom}.tape", base.with_(outer_lr=lr, outer_momentum=mom, max_lag_rounds=lag))
    cv = chaos.syncer.val[-1][1]
    by_n: dict[int, list[float]] = {}
    for n, r in chaos.syncer.shrink:
        by_n.setdefault(n, []).append(r)
    print("chaos run, |merged|/mean|own| by contributions merged: " +
          ", ".join(f"{n}: {sum(v_) / len(v_):.3f} ({len(v_)} merges)" for n, v_ in sorted(by_n.items())))
    print(f"best without faults: outer lr {lr}, momentum {mom}, lag {lag}: {v:.4f} ({v / ref:.3f}x the synchronous baseline); "
          f"the chaos run with it: {cv:.4f} ({cv / ref:.3f}x; no-fault / chaos {v / cv:.3f}x)")


if __name__ == "__main__":
    main()
