"""The communication ablation: outer gradients and fragment updates at 32 (float32, the
reference), 16, 8, 4, 2 and 1 bits per element (runs/diloco/quant.py, error feedback).

Runs the DiLoCo reference run (learners as threads, the demo's size, no faults) per bit
width with the same seeds, ``--repeats`` times, and prints the median final validation
loss as a ratio to the uncompressed runs' median, the range over the repeats, and the
payload bytes sent each way as a ratio to the uncompressed bytes. The quorum is every
learner (K = M), so every merge takes every learner's contribution; what still differs
from run to run is when each learner applies a merged fragment (it adopts it at its
next step boundary, wherever the wall clock put it), which moves the final loss by a
few percent: the repeats measure that spread. With ``--plot PNG`` it draws the
validation curves of the first repeat.

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
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="diloco-comm-"))
    base = demo_config(quick=args.quick, transport="threads").with_(snapshot_every=0, chaos=False)
    base = base.with_(quorum=base.learners)
    bits_list = [int(b) for b in args.bits.split(",")]
    runs: dict[int, list] = {b: [] for b in bits_list}
    for r in range(args.repeats):  # interleaved: every width once per repeat
        for bits in bits_list:
            runs[bits].append(record(out / f"bits-{bits}-{r}.tape", base.with_(comm_bits=bits)))
    rows = [(b, runs[b][0]) for b in bits_list]

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    vals = {b: [x.syncer.val[-1][1] for x in runs[b]] for b in bits_list}
    ref_b = bits_list[0]
    v0, up0, down0 = med(vals[ref_b]), runs[ref_b][0].syncer.bytes_up, runs[ref_b][0].syncer.bytes_down
    print(f"{'bits':>4} {'median val loss':>15} {'vs 32-bit':>9} {'range over repeats':>19} {'bytes up':>10} "
          f"{'vs 32':>7} {'bytes down':>10} {'vs 32':>7}")
    for bits in bits_list:
        sy = runs[bits][0].syncer
        v = med(vals[bits])
        print(f"{bits:>4} {v:>15.4f} {v / v0:>8.3f}x {min(vals[bits]) / v0:>8.3f}-{max(vals[bits]) / v0:.3f}x "
              f"{sy.bytes_up:>10} {sy.bytes_up / up0:>6.3f}x {sy.bytes_down:>10} {sy.bytes_down / down0:>6.3f}x",
              flush=True)
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
