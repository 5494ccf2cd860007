"""Standard averaging vs radial-directional averaging (RDA), in the merge and in the model update.

The DiLoCo reference run (learners as threads), with the same seeds, under two schedules
(no faults; the seeded chaos) and five variants:

- ``mean``: the token-weighted mean of the outer gradients, learners adopt the merged
  fragment (``merge="mean", model_update="replace"``: the default; the reference);
- ``rda merge``: RDA of the outer gradients (``merge="rda"``);
- ``mix update``: learners combine their own update with the global one, Streaming
  DiLoCo's mix ``alpha * local + (1 - alpha) * global`` (``model_update="mean"``: the
  control for the next line, same weights);
- ``rda update``: the same two updates averaged radially-directionally
  (``model_update="rda"``);
- ``rda both``: RDA in the merge and in the model update.

Prints each run's final validation loss and its ratio to ``mean`` of the same schedule
(medians over ``--repeats`` interleaved rounds: a threads run's grace windows and inbox
decisions depend on timing, so two runs of one config differ a little; the spread of the
``mean`` runs is printed as the A/A range). The runs are short (the demo's quick size
unless --full): read the ratios as this scale's answer, not the paper's.

Usage: python bench/diloco_merge.py [--full] [--repeats N] [--alpha A] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from runs.diloco import record  # noqa: E402
from runs.diloco.demo import demo_config  # noqa: E402

VARIANTS = (("mean", "mean", "replace"), ("rda merge", "rda", "replace"), ("mix update", "mean", "mean"),
            ("rda update", "mean", "rda"), ("rda both", "rda", "rda"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the demo's full size instead of the quick one")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds of every run (medians)")
    ap.add_argument("--alpha", type=float, default=0.5, help="update_alpha: the weight of a learner's own update")
    ap.add_argument("--out", default=None, help="where the tapes go (default: a temporary directory)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="diloco-merge-"))
    base = demo_config(quick=not args.full, transport="threads").with_(snapshot_every=0, update_alpha=args.alpha)
    vals: dict[tuple[str, str], list[float]] = {}
    for r in range(args.repeats):
        for chaos in (False, True):
            sched = "chaos" if chaos else "no faults"
            for name, merge, update in VARIANTS:
                cfg = base.with_(chaos=chaos, merge=merge, model_update=update)
                res = record(out / f"r{r}-{'chaos' if chaos else 'nofault'}-{name.replace(' ', '-')}.tape", cfg)
                vals.setdefault((sched, name), []).append(res.syncer.val[-1][1])
                print(f"round {r}: {sched:<9} {name:<10} {vals[(sched, name)][-1]:.4f}", file=sys.stderr, flush=True)
    print(f"{args.repeats} round(s), update_alpha {args.alpha}, {'full' if args.full else 'quick'} size")
    print(f"{'schedule':<10} {'variant':<10} {'final val loss':>14} {'vs mean':>8}  (paired ratios per round)")
    for sched in ("no faults", "chaos"):
        ref = vals[(sched, "mean")]
        if len(ref) > 1:
            aa = [x / statistics.median(ref) for x in ref]
            print(f"{sched:<10} {'A/A':<10} {'':>14} {min(aa):.3f}-{max(aa):.3f}x  (the mean runs vs their median)")
        for name, _, _ in VARIANTS:
            v = vals[(sched, name)]
            ratios = [x / y for x, y in zip(v, ref)]
            print(f"{sched:<10} {name:<10} {statistics.median(v):>14.4f} {statistics.median(ratios):>7.3f}x  "
                  + " ".join(f"{x:.3f}" for x in ratios))


if __name__ == "__main__":
    main()
