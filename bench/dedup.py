"""Dedup benchmark (issue 17 item 6; spec/format-2.md §V.4): a save where 90 % of the bytes did not
change since the previous checkpoint of the run (frozen base weights under LoRA-style adapters).

Figures, against a full save of the same state measured side by side in this run:

- bytes written by the dedup save / bytes of a full save: target <= 0.15;
- time of the dedup save / time of a full save (durable, digests on): target <= 0.25;
- the check of what a dedup save links (spec/format-2.md §V.4.6): the time of a dedup save
  with it (every linked byte re-hashed: ``dedup_rehash_every=1``, the default; and a window
  of 1/4 of the chunks: ``=4``) against the same save without it (the check replaced by a
  no-op, as before issue 22) and against a full save. The shared file was written or read
  moments before, so its re-hash reads the page cache: a file evicted from it costs a read
  from the device on top (what the first dedup save after a restart pays);

as medians of paired ratios over >= 7 interleaved rounds, with an A/A control (a full save
against a full save). Each round trains the adapters one step, then saves twice: in full to a
scratch directory, and with dedup from the previous dedup checkpoint; retention-like cleanup
keeps two dedup checkpoints, so shared files outlive the checkpoint that wrote them.

Usage: python bench/dedup.py [--rounds 7] [--base-mib 360] [--dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import ckpt  # noqa: E402
from ckpt import _partfiles  # noqa: E402
from ckpt.knobs import override  # noqa: E402

MiB = 1 << 20


class LoRA(torch.nn.Module):
    """A frozen base of ``n`` square layers with rank-r adapters (trainable)."""

    def __init__(self, base_mib: int, width: int = 2048, rank: int = 32) -> None:
        super().__init__()
        n = max(1, base_mib * MiB // (width * width * 4))
        torch.manual_seed(0)
        self.base = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(n))
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.a = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(width, rank) * 0.01) for _ in range(n))
        self.b = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(rank, width)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, a, b in zip(self.base, self.a, self.b):
            x = torch.tanh(lin(x) + x @ a @ b)
        return x


def _written(path: str) -> int:
    r = ckpt.open(path)
    return sum(f.size for f in r.manifest.files if f.origin is None) + os.path.getsize(os.path.join(path, "MANIFEST"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--base-mib", type=int, default=360)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="bench-dedup-", dir=args.dir)
    try:
        model = LoRA(args.base_mib)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        state = {"model": model, "optim": opt}
        g = torch.Generator().manual_seed(2)

        def step() -> None:
            x = torch.randn(8, 2048, generator=g)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

        step()
        prev = os.path.join(d, "run", "step-00000000")
        ckpt.save(prev, state, dedup=True)  # the first checkpoint of the run writes everything
        total = sum(f.size for f in ckpt.open(prev).manifest.files)
        changed = sum(t.numel() * t.element_size() for t in [*model.a, *model.b]) * 3  # adapters + 2 moments
        history = [prev]
        time_ratio, bytes_ratio, aa = [], [], []
        check_vs_nocheck: dict[str, list[float]] = {"k1": [], "k4": []}
        check_vs_full: dict[str, list[float]] = {"k1": [], "k4": []}
        checked = _partfiles.check_linked
        for i in range(1, args.rounds + 1):
            step()
            full, full2 = os.path.join(d, f"full-{i}"), os.path.join(d, f"full2-{i}")
            path = os.path.join(d, "run", f"step-{i:08d}")
            t: dict[str, float] = {}
            variants = {kind: os.path.join(d, "run", f"{kind}-{i:08d}") for kind in ("nocheck", "k4")}
            order = ("full", "dedup", "nocheck", "k4", "full2") if i % 2 else ("k4", "nocheck", "dedup", "full2", "full")
            for kind in order:
                t0 = time.perf_counter()
                if kind == "dedup":
                    ckpt.save(path, state, dedup_from=prev)  # the default: every linked byte re-hashed
                elif kind == "nocheck":
                    _partfiles.check_linked = lambda *a, **k: None  # the save as it was before the check
                    try:
                        ckpt.save(variants[kind], state, dedup_from=prev)
                    finally:
                        _partfiles.check_linked = checked
                elif kind == "k4":
                    with override(dedup_rehash_every=4):
                        ckpt.save(variants[kind], state, dedup_from=prev)
                else:
                    ckpt.save(full if kind == "full" else full2, state)
                t[kind] = time.perf_counter() - t0
            for kind, key in (("dedup", "k1"), ("k4", "k4")):
                check_vs_nocheck[key].append(t[kind] / t["nocheck"])
                check_vs_full[key].append((t[kind] - t["nocheck"]) / t["full"])
            for v in variants.values():
                shutil.rmtree(v)
            time_ratio.append(t["dedup"] / t["full"])
            aa.append(t["full2"] / t["full"])
            bytes_ratio.append(_written(path) / sum(f.size for f in ckpt.open(full).manifest.files))
            shutil.rmtree(full)
            shutil.rmtree(full2)
            history.append(path)
            if len(history) > 2:
                shutil.rmtree(history.pop(0))  # retention keep_last=2: the shared bytes stay linked
            prev = path
        ckpt.open(prev).verify()
        out = {
            "state_mib": total / MiB,
            "unchanged_share": 1 - changed / total,
            "bytes_written_vs_full": statistics.median(bytes_ratio),
            "time_vs_full": statistics.median(time_ratio),
            "aa_control": statistics.median(aa),
            "time_rounds": time_ratio,
            "check_k1_vs_nocheck": statistics.median(check_vs_nocheck["k1"]),
            "check_k4_vs_nocheck": statistics.median(check_vs_nocheck["k4"]),
            "check_k1_cost_vs_full": statistics.median(check_vs_full["k1"]),
            "check_k4_cost_vs_full": statistics.median(check_vs_full["k4"]),
        }
        print(f"state {out['state_mib']:.0f} MiB, {100 * out['unchanged_share']:.1f} % of the bytes unchanged between saves; "
              f"{args.rounds} interleaved rounds, median of paired ratios against a full save:")
        print(f"  bytes written, dedup / full: {out['bytes_written_vs_full']:.3f} (target <= 0.15)")
        print(f"  save time, dedup / full:     {out['time_vs_full']:.3f} (target <= 0.25; A/A control {out['aa_control']:.2f})")
        print(f"  the check of linked files (§V.4.6), dedup save with it / without it: "
              f"{out['check_k1_vs_nocheck']:.3f} (full re-hash, K=1), {out['check_k4_vs_nocheck']:.3f} (window, K=4)")
        print(f"  its added time / a full save:  {out['check_k1_cost_vs_full']:.3f} (K=1), "
              f"{out['check_k4_cost_vs_full']:.3f} (K=4)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
