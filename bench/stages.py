"""Pipeline stage skipping over several chaos seeds: are the demo's answers the seed's, or luck?

For each seed, the demo's full configuration (every actor a thread: bit-identical to the
processes) is run five times on that seed's failure schedule: shared fixed projections with
and without failures, per-boundary random projections with and without failures, and the
shared configuration waiting for the failed stage instead of skipping it. It prints, per
seed and as the median over seeds, the figures as ratios against the issue's references:

- final validation loss with failures / the same configuration's no-failure run;
- stage-steps kept busy with skipping / with the wait-for-recovery baseline;
- loss degradation (chaos - no-failure) of shared fixed projections against per-boundary random ones.

Usage: python bench/stages.py [--seeds 3] [--steps 120] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402

from runs.stages.demo import demo_config  # noqa: E402
from runs.stages.report import busy_fraction, final_val  # noqa: E402
from runs.stages.run import record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="global steps (default: the demo's)")
    ap.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out or tempfile.mkdtemp(prefix="stages-bench-"))
    base = demo_config(transport="threads").with_(snapshot_at=())
    if args.steps:
        base = base.with_(steps=args.steps)
    print(f"{base.replicas} replicas x {base.stages} stages, {base.steps} steps, p = {base.p:g}, k = {base.k}, "
          f"edge p = {base.edge_p:g}; runs under {out}")
    rows = []
    t0 = time.monotonic()
    for seed in range(args.seeds):
        cfg = base.with_(seed=seed)
        runs = {}
        for name, c in (("shared-chaos", cfg), ("shared-calm", cfg.with_(chaos=False)),
                        ("random-chaos", cfg.with_(compression="random")),
                        ("random-calm", cfg.with_(compression="random", chaos=False)),
                        ("shared-wait", cfg.with_(policy="wait"))):
            runs[name] = record(c, out / f"seed{seed}" / name)
        sc, sk = final_val(runs["shared-chaos"]), final_val(runs["shared-calm"])
        rc, rk = final_val(runs["random-chaos"]), final_val(runs["random-calm"])
        row = {"seed": seed, "outages": len(runs["shared-chaos"].ctl.schedule.outages),
               "loss_shared": sc / sk, "loss_random": rc / rk,
               "busy": busy_fraction(runs["shared-chaos"]) / busy_fraction(runs["shared-wait"]),
               "wait_loss": final_val(runs["shared-wait"]) / sc,
               "deg_shared": sc - sk, "deg_random": rc - rk}
        rows.append(row)
        print(f"seed {seed}: {row['outages']} outages; loss with failures / without: shared {row['loss_shared']:.4f}, "
              f"random {row['loss_random']:.4f}; busy stage-steps skipping / waiting {row['busy']:.3f} (waiting's "
              f"loss {row['wait_loss']:.4f} x skipping's); degradation (chaos - no-failure loss) shared {row['deg_shared']:+.4f}, "
              f"random {row['deg_random']:+.4f}",
              flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "seed"}
    print(f"median over {len(rows)} seeds: loss with failures / without: shared {med['loss_shared']:.4f}, random "
          f"{med['loss_random']:.4f}; busy stage-steps skipping / waiting {med['busy']:.3f}; waiting's final loss "
          f"{med['wait_loss']:.4f} x skipping's; degradation shared {med['deg_shared']:+.4f}, random "
          f"{med['deg_random']:+.4f}; shared less disrupted on {sum(r['deg_shared'] < r['deg_random'] for r in rows)}"
          f"/{len(rows)} seeds ({time.monotonic() - t0:.0f} s, threads)")


if __name__ == "__main__":
    main()
