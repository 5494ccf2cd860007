"""What torch.optim's first use costs a fresh worker process (the stages run's workers).

Each round starts fresh interpreters, interleaved: ``adamw`` builds a stage-sized module
and takes one ``torch.optim.AdamW`` step; ``plain`` takes the same first step by hand
(``p.add_(grad)``: no ``torch.optim`` import, so no ``torch._dynamo`` on first use); a
second ``plain`` is the A/A control. Printed: medians of the paired per-round figures,
the seconds from process start to the first step done, and the ratio against ``plain``.

    python bench/optim_startup.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CHILD = r"""
import sys, time
t0 = time.perf_counter()
import torch
from torch import nn
torch.set_num_threads(1)
m = nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
if sys.argv[1] == "adamw":
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
m(torch.randint(0, 64, (8, 32))).square().mean().backward()
if sys.argv[1] == "adamw":
    opt.step()
else:
    with torch.no_grad():
        for p in m.parameters():
            p.add_(p.grad, alpha=-3e-3)
print(time.perf_counter() - t0)
"""


def _once(which: str) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, which], check=True, capture_output=True, text=True)
    return float(out.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    _once("plain")  # warm the page cache once: every round then reads torch from memory
    rows = []
    for _ in range(args.rounds):
        a, p1, p2 = _once("adamw"), _once("plain"), _once("plain")
        rows.append((a, p1, p2))
    med = statistics.median
    print(f"fresh process to its first optimizer step, medians of {args.rounds} interleaved rounds:")
    print(f"  torch.optim.AdamW {med(r[0] for r in rows):.3f} s, plain update {med(r[1] for r in rows):.3f} s")
    print(f"  added by torch.optim's first use: {med(r[0] - r[1] for r in rows):+.3f} s per process, "
          f"ratio {med(r[0] / r[1] for r in rows):.3f}x (A/A control {med(r[2] / r[1] for r in rows):.3f}x)")


if __name__ == "__main__":
    main()
