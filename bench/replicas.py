"""Replica run throughput: torchft + our tape vs plain DDP, and the SDC check's cost.

Same replica groups (3 groups of 1 rank), same tiny transformer, same global batch split
the same way, no faults. Four configurations per round, in interleaved rounds (order
shuffled per round) so that drift on a shared machine hits all alike:

* ``ddp``: torch ``DistributedDataParallel`` over one static gloo group of the 3 ranks;
* ``ddp2``: the same again (A/A control: its gap to ``ddp`` is the noise floor);
* ``ft``: torchft (a ``Manager`` per rank, lighthouse quorum and commit RPCs every step,
  bucketed all-reduce through the manager) with every decision and digest on our tape,
  SDC check off;
* ``ft+sdc``: the same with the cross-replica SDC check on (bucket digests and one small
  all-reduce of them per accumulation boundary).

Ranks run as threads of this process (torchft's Managers as torchft's own integration
tests run them), so process start-up is not timed; steps/s is measured per round over
the steps after a warm-up. Printed: median over rounds of the paired ratios
ft/ddp - 1 (target <= 5%), ft+sdc/ft - 1 (target <= 2%), ddp2/ddp - 1 (noise floor).

Usage: python bench/replicas.py [--rounds R] [--steps S] [--warmup W]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from runs.replicas import ReplicaConfig, record  # noqa: E402
from runs.replicas.data import share  # noqa: E402
from runs.replicas.worker import build_state, step_loss  # noqa: E402

TARGET_FT = 0.05
TARGET_SDC = 0.02
GROUPS = (("g0", 1), ("g1", 1), ("g2", 1))


def ddp_round(cfg: ReplicaConfig, warmup: int) -> float:
    """Seconds per step of plain DDP, measured after the warm-up (slowest rank)."""
    torch.set_num_threads(1)
    world = len(cfg.groups)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    per: list[float] = [0.0] * world

    def rank_main(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        pg = dist.ProcessGroup(store, r, world)  # what init_process_group builds, without the global default
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                             dist.ProcessGroupGloo(store, r, world, timedelta(seconds=60)))
        st = build_state(cfg)
        ddp = torch.nn.parallel.DistributedDataParallel(st.model, process_group=pg)
        t0 = 0.0
        for s in range(cfg.steps):
            if s == warmup:
                t0 = time.perf_counter()
            ids = st.cursor.peek()
            rows = share(len(ids), world, r, 1, 0)
            st.optim.zero_grad(set_to_none=True)
            # the same scaled loss as the replica run; DDP averages over the ranks
            loss = _loss_ddp(st, ids, rows, world, ddp)
            loss.backward()
            st.optim.step()
            st.cursor.advance()
        per[r] = (time.perf_counter() - t0) / (cfg.steps - warmup)

    errors: list[BaseException] = []

    def guarded(r: int) -> None:
        try:
            rank_main(r)
        except BaseException as e:  # reported below
            errors.append(e)

    ts = [threading.Thread(target=guarded, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return max(per)


def _loss_ddp(st, ids, rows, participants, ddp):
    model = st.model
    st.model = ddp  # the forward goes through DDP (its hooks reduce the gradients)
    try:
        return step_loss(st, ids, rows, participants)
    finally:
        st.model = model


def ft_round(cfg: ReplicaConfig, warmup: int) -> float:
    """Seconds per step of the torchft run with the tape, after the warm-up (slowest rank)."""
    stamps: dict[str, dict[int, float]] = {}
    lock = threading.Lock()

    def on_commit(actor: str, step: int) -> None:
        with lock:
            stamps.setdefault(actor, {})[step] = time.perf_counter()

    with tempfile.TemporaryDirectory() as d:
        record(Path(d) / "run.tape", cfg, transport="threads", on_commit=on_commit)
    # a rank that a slow start left out of the first quorum heals later and lacks early stamps
    return max((s[cfg.steps - 1] - s[warmup - 1]) / (cfg.steps - warmup) for s in stamps.values()
               if warmup - 1 in s and cfg.steps - 1 in s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=6)
    a = ap.parse_args()
    base = ReplicaConfig(groups=GROUPS, steps=a.steps, param_every=0)
    cfgs = {"ddp": base, "ddp2": base, "ft": ReplicaConfig(groups=GROUPS, steps=a.steps, sdc=False, param_every=0),
            "ft+sdc": base}
    runs = {"ddp": ddp_round, "ddp2": ddp_round, "ft": ft_round, "ft+sdc": ft_round}
    rng = random.Random(0)
    times: dict[str, list[float]] = {k: [] for k in cfgs}
    for r in range(a.rounds):
        order = list(cfgs)
        rng.shuffle(order)
        for k in order:
            times[k].append(runs[k](cfgs[k], a.warmup))
        print(f"round {r + 1}/{a.rounds}: " + "  ".join(f"{k} {1000 * times[k][-1]:.1f} ms/step" for k in cfgs),
              flush=True)

    def med(x: str, y: str) -> float:
        return statistics.median(times[x][i] / times[y][i] for i in range(a.rounds)) - 1

    print(f"\nmedian step time: " + ", ".join(f"{k} {1000 * statistics.median(v):.1f} ms" for k, v in times.items()))
    print(f"torchft + tape vs plain DDP (same groups, no faults): {100 * med('ft', 'ddp'):+.1f}% "
          f"(target <= {100 * TARGET_FT:.0f}%)")
    print(f"SDC cross-replica check per step: {100 * med('ft+sdc', 'ft'):+.1f}% (target <= {100 * TARGET_SDC:.0f}%)")
    print(f"A/A control (plain DDP vs itself): {100 * med('ddp2', 'ddp'):+.1f}%")


if __name__ == "__main__":
    main()
