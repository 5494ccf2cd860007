"""Time to resume mid-epoch: ``ckpt.data.ResumableLoader`` against skip-batches.

Resuming at sample k of an epoch means: build the loader, restore the cursor, and get
the first batch after k. ``ResumableLoader`` indexes into the epoch's permutation, so the
cost should not depend on k (ratio to k=10 flat at ~1). The baseline is what a plain
``DataLoader`` must do: draw the same shuffled order and iterate, discarding ``k / B``
batches, so it grows linearly in k.

The dataset is synthetic (2 * 10**6 samples, ``__getitem__`` returns the index), so the
baseline is as cheap as skipping can be; real datasets make it slower, not faster.
The baseline is measured directly up to ``--baseline-cap`` seconds of estimated run
time; beyond that it is extrapolated linearly from the largest measured point, and the
output says so.

Usage: python bench/resume.py [--samples N] [--batch B] [--repeat R] [--baseline-cap S]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402
from torch.utils.data import DataLoader, RandomSampler  # noqa: E402

from ckpt.data import EpochOrder, ResumableLoader  # noqa: E402


class Synthetic:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _collate(items: list[int]) -> torch.Tensor:
    return torch.tensor(items)


def resume_ours(n: int, batch: int, k: int, num_workers: int) -> torch.Tensor:
    loader = ResumableLoader(
        Synthetic(n), seed=0, global_batch_size=batch, world_size=1, rank=0, collate_fn=_collate,
        num_workers=num_workers, seed_sample_rngs=True,
    )
    state = loader.state_dict()
    state["position"] = k  # what a checkpoint taken after k samples holds
    loader.load_state_dict(state)
    return next(iter(loader))


def resume_skip(n: int, batch: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(Synthetic(n), batch_size=batch, sampler=RandomSampler(Synthetic(n), generator=g),
                        collate_fn=_collate, generator=g)
    it = iter(loader)
    for _ in range(k // batch):
        next(it)
    return next(it)


def _time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _time_interleaved(fns: dict[int, Callable[[], object]], repeat: int) -> dict[int, float]:
    """Median per key, rounds interleaved (alternating direction) so drift hits all keys alike."""
    times: dict[int, list[float]] = {k: [] for k in fns}
    keys = list(fns)
    for r in range(repeat):
        for k in keys if r % 2 == 0 else keys[::-1]:
            t = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2 * 10**6)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--baseline-cap", type=float, default=60.0, help="seconds one baseline run may take")
    args = ap.parse_args()
    n, b = args.samples, args.batch
    points = [10, 10**4, 10**6]
    for k in points:
        if k % b or k >= n:
            raise SystemExit(f"resume point {k} must be a multiple of --batch and below --samples")

    # Correctness first: the batch after a resume is the epoch order at [k, k + b).
    order = EpochOrder(n, 0, 0)
    for k in points:
        assert resume_ours(n, b, k, 0).tolist() == order.indices(range(k, k + b)), k

    ours = _time_interleaved({k: (lambda k=k: resume_ours(n, b, k, 0)) for k in points}, args.repeat)
    ours_w = _time_interleaved({k: (lambda k=k: resume_ours(n, b, k, 2)) for k in points}, max(2, args.repeat // 4))
    base: dict[int, tuple[float, str]] = {}
    last_measured: tuple[int, float] | None = None
    for k in [10, 10**4, 10**5, 10**6]:
        if last_measured is not None and last_measured[1] * k / last_measured[0] > args.baseline_cap:
            k0, t0 = last_measured
            base[k] = (t0 * k / k0, f"extrapolated from k={k0}")
            continue
        t = _time(lambda k=k: resume_skip(n, b, k), 1 if k >= 10**5 else 3)
        base[k] = (t, "measured")
        if k >= 10**4:
            last_measured = (k, t)

    print(f"resume mid-epoch, {n:,} samples, global batch {b}, torch {torch.__version__}, "
          f"median of {args.repeat} interleaved (ckpt.data, workers: {max(2, args.repeat // 4)}) / 1-3 (baseline)")
    print(f"{'resume at k':>12} | {'ckpt.data w=0':>14} {'ratio':>6} | {'ckpt.data w=2':>14} {'ratio':>6} | "
          f"{'skip-batches':>13} {'ratio':>8}  baseline")
    for k in points:
        bt, how = base[k]
        print(f"{k:>12,} | {ours[k] * 1e3:>11.2f} ms {ours[k] / ours[10]:>6.2f} | "
              f"{ours_w[k] * 1e3:>11.2f} ms {ours_w[k] / ours_w[10]:>6.2f} | "
              f"{bt * 1e3:>10.1f} ms {bt / base[10][0]:>8.1f}  {how}")
    print(f"(skip-batches at k=100,000: {base[10**5][0] * 1e3:.1f} ms, {base[10**5][1]}; its k=10 cost is "
          f"mostly RandomSampler's O(n) randperm, then ~{(base[10**6][0] - base[10][0]) / 10**6 * 1e6:.2f} us "
          f"per skipped sample)")
    print(f"at k=10^6 skip-batches / ckpt.data = {base[10**6][0] / ours[10**6]:,.0f}x")


if __name__ == "__main__":
    main()
