"""The communication ablation: outer gradients and fragment updates at 32 (float32, the
reference), 16, 8, 4, 2 and 1 bits per element (runs/diloco/quant.py, error feedback).

Runs the DiLoCo reference run (learners as threads, the demo's size, no faults) once per
bit width with the same seeds and prints the final validation loss as a ratio to the
uncompressed run's and the payload bytes sent each way as a ratio to its bytes. The
quorum is every learner (K = M), so every merge takes the same contributions whatever
the timing: the runs differ by the encoding alone. With ``--plot PNG`` it draws the
validation curves and the bytes.

Usage: python bench/diloco_comm.py [--quick] [--bits 32,16,8,4,2,1] [--plot docs/diloco-comm.png] [--out DIR]
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
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--bits", default="32,16,8,4,2,1")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="diloco-comm-"))
    base = demo_config(quick=args.quick, transport="threads").with_(snapshot_every=0, chaos=False)
    base = base.with_(quorum=base.learners)
    rows = []
    for bits in [int(b) for b in args.bits.split(",")]:
        res = record(out / f"bits-{bits}.tape", base.with_(comm_bits=bits))
        rows.append((bits, res))
    ref = rows[0][1]
    v0, up0, down0 = ref.syncer.val[-1][1], ref.syncer.bytes_up, ref.syncer.bytes_down
    print(f"{'bits':>4} {'final val loss':>14} {'vs 32-bit':>9} {'bytes up':>10} {'vs 32':>7} {'bytes down':>10} "
          f"{'vs 32':>7}")
    for bits, res in rows:
        sy = res.syncer
        v = sy.val[-1][1]
        print(f"{bits:>4} {v:>14.4f} {v / v0:>8.3f}x {sy.bytes_up:>10} {sy.bytes_up / up0:>6.3f}x "
              f"{sy.bytes_down:>10} {sy.bytes_down / down0:>6.3f}x", flush=True)
    if args.plot:
        from runs.common.plot import Curve, loss_plot

        per_sync = base.inner_h / base.fragments
        curves = [Curve(f"{bits}-bit ({res.syncer.bytes_up / up0:.2f}x bytes up)",
                        [(s + 1) * per_sync for s, _ in res.syncer.val], [v for _, v in res.syncer.val])
                  for bits, res in rows]
        loss_plot(args.plot, curves, xlabel="inner steps", title="DiLoCo: outer-gradient bits vs validation loss "
                  "(no faults, K = M, same seeds)")
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
