"""Replica run throughput: torchft + our tape vs plain DDP, and the SDC check's cost.

Same replica groups (``--groups`` groups of one rank, each rank its own process as in a
real job), same tiny transformer, same global batch split the same way, no faults. Per
round, in a shuffled order so that drift on a shared machine hits all alike:

* ``ddp`` / ``ddp2``: torch ``DistributedDataParallel`` over one static gloo group (twice:
  ``ddp2`` vs ``ddp`` is the A/A control, the noise floor of the ft/ddp ratio);
* ``ft`` / ``ft2``: torchft (a ``Manager`` per rank, async quorum from the lighthouse,
  one fault-tolerant all-reduce of the gradient, torchft's commit RPC every step) with
  every decision and digest on our tape, SDC check off (twice: the A/A control of the
  SDC ratio);
* ``ft+sdc``: the same with the cross-replica SDC check on (bucket digests of the sent
  and the reduced gradient and one small all-reduce of them per step);
* ``ftbare``: torchft alone, as its own examples use it (a ``Manager`` per rank, async
  quorum, ``Manager.allreduce`` of the flat gradient, ``should_commit``, the optimizer
  step; no tape, no exchange, no recovery transport of ours): the floor that torchft's own
  per-step RPCs (quorum, ``should_commit``) set.

Where the time of a step goes: every rank of a recorded run laps a clock at the parts of
its step (runs/replicas/timing.py: quorum wait, compute, gradient gather, all-reduce, SDC,
exchange, should_commit, optimizer, tape, rest); ``ftbare`` and ``ddp`` lap theirs too
(DDP's all-reduce runs inside its backward). Printed per size: each part's mean ms per
step after the warm-up and its share of the step, beside the DDP step.

Two step sizes: the demo's global batch (a DDP step of some 25 ms here) and a larger one
(``--big``, a DDP step of some 200 ms, nearer where a real run sits). Each rank stamps
its own clock at every step end (DDP) or commit (torchft); a run's step time is the
slowest rank's median step interval after the warm-up (a load burst moves a mean more). Printed per size: the medians over
rounds of the paired ratios ft/ddp - 1 (target <= 5%), ft+sdc/ft - 1 (target <= 2%) and
their A/A controls, with the spread (min..max) of each over the rounds.

Usage: python bench/replicas.py [--rounds R] [--steps S] [--warmup W] [--big B] [--sizes small,big]
                                [--runs ddp,ddp2,ft,ft2,ft+sdc,ftbare]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from runs.common.procs import join_gloo, serve_store  # noqa: E402
from runs.replicas import ReplicaConfig, record  # noqa: E402
from runs.replicas.data import share  # noqa: E402
from runs.replicas.timing import StepClock  # noqa: E402
from runs.replicas.worker import build_state, step_loss  # noqa: E402

TARGET_FT = 0.05
TARGET_SDC = 0.02


def _ddp_rank(r: int, world: int, cfg_d: dict, port: int, out: "mp.Queue") -> None:  # pragma: no cover - child
    torch.set_num_threads(1)
    import torch.distributed as dist

    cfg = ReplicaConfig.from_dict(cfg_d)
    join_gloo(r, world, port, timeout_s=120)  # the store ddp_run serves
    st = build_state(cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(st.model)
    model = st.model
    stamps = []
    clock = StepClock()
    dist.barrier()
    for _ in range(cfg.steps):
        clock.start()
        ids = st.cursor.peek()
        rows = share(len(ids), world, r, 1, 0)
        st.optim.zero_grad(set_to_none=True)
        st.model = ddp  # the forward goes through DDP (its hooks reduce the gradients during the backward)
        try:
            loss = step_loss(st, ids, rows, world)  # the replica run's loss: DDP averages over the ranks
        finally:
            st.model = model
        loss.backward()  # DDP's all-reduce runs in here, overlapped with the backward
        clock.lap("compute")
        st.optim.step()
        st.cursor.advance()
        clock.lap("optim")
        clock.end()
        stamps.append(time.perf_counter())
    out.put((r, stamps, clock.parts))
    dist.barrier()
    dist.destroy_process_group()


def _bare_rank(r: int, world: int, cfg_d: dict, lighthouse: str, out: "mp.Queue") -> None:  # pragma: no cover - child
    """torchft alone: one rank of a replica group of one, the loop torchft's examples run."""
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    cfg = ReplicaConfig.from_dict(cfg_d)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    st = build_state(cfg)
    timeout = timedelta(seconds=cfg.timeout_s)
    m = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=lambda sd: None, state_dict=lambda: {},
                min_replica_size=world, use_async_quorum=True, timeout=timeout, quorum_timeout=timedelta(seconds=120),
                rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
                replica_id=f"b{r}", hostname="127.0.0.1", init_sync=False)
    params = list(st.model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params) + 1)
    stamps = []
    clock = StepClock()
    while m.current_step() < cfg.steps:
        clock.start()
        m.start_quorum()
        clock.lap("quorum")
        ids = st.cursor.peek()
        rows = share(len(ids), world, r, 1, 0)  # no failures here: the quorum is the static one
        st.optim.zero_grad(set_to_none=True)
        loss = step_loss(st, ids, rows, world)
        loss.backward()
        clock.lap("compute")
        torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)], out=flat)
        clock.lap("gather")
        m.allreduce(flat).wait()  # waits for the quorum first
        clock.lap("allreduce")
        if m.should_commit():
            o = 0
            for p in params:
                p.grad = flat[o : o + p.numel()].view_as(p)
                o += p.numel()
            clock.lap("commit")
            st.optim.step()
            st.cursor.advance()
            clock.lap("optim")
            stamps.append(time.perf_counter())
        clock.end()
    out.put((r, stamps, clock.parts))
    out.close()
    out.join_thread()  # the queue's feeder thread has written it (os._exit would drop it)
    os._exit(0)  # torchft's server threads need no orderly goodbye


def _collect(ps: list, out: "mp.Queue", warmup: int, runs: str) -> float:
    for p in ps:
        p.start()
    got = [out.get(timeout=300) for _ in ps]
    for p in ps:
        p.join(60)
    per = {r: _per_step(s, warmup) for r, s, _ in got}
    slowest = max(per, key=per.__getitem__)
    PARTS_LOG.setdefault(runs, []).append(_mean_parts(next(p for r, _, p in got if r == slowest), warmup))
    return per[slowest]


def ddp_run(cfg: ReplicaConfig, warmup: int, name: str = "ddp") -> float:
    """Seconds per step of plain DDP after the warm-up (slowest rank), a process per rank."""
    ctx = mp.get_context("spawn")
    world = len(cfg.groups)
    out = ctx.Queue()
    # the rendezvous, served here on the port the OS gave it as it listened (held until the
    # ranks are done): a port found free and handed over could be taken in between
    served = serve_store(timeout_s=120)
    ps = [ctx.Process(target=_ddp_rank, args=(r, world, cfg.to_dict(), served.port, out), daemon=True)
          for r in range(world)]
    try:
        return _collect(ps, out, warmup, name)
    finally:
        del served


def bare_run(cfg: ReplicaConfig, warmup: int, name: str = "ftbare") -> float:
    """Seconds per step of torchft alone after the warm-up (slowest rank), a process per rank."""
    from torchft._torchft import LighthouseServer

    ctx = mp.get_context("spawn")
    world = len(cfg.groups)
    out = ctx.Queue()
    lh = LighthouseServer(bind="[::]:0", min_replicas=world, join_timeout_ms=cfg.join_timeout_ms,
                          quorum_tick_ms=cfg.quorum_tick_ms, heartbeat_timeout_ms=cfg.heartbeat_timeout_ms)
    try:
        ps = [ctx.Process(target=_bare_rank, args=(r, world, cfg.to_dict(), lh.address(), out), daemon=True)
              for r in range(world)]
        return _collect(ps, out, warmup, name)
    finally:
        lh.shutdown()


PARTS_LOG: dict[str, list[dict[str, float]]] = {}  # per run kind, per round: mean seconds per part


def _mean_parts(parts: dict[str, list[float]], warmup: int) -> dict[str, float]:
    return {k: statistics.fmean(v[warmup:]) for k, v in parts.items() if len(v) > warmup}


def _per_step(stamps: list[float], warmup: int) -> float:
    # the median of the step intervals after the warm-up: a burst of load from other jobs on
    # the shared machine moves a mean far more than it moves the median
    return statistics.median(b - a for a, b in zip(stamps[warmup - 1 : -1], stamps[warmup:]))


SDC_SHARE: list[float] = []  # per ft+sdc run: the SDC check's seconds per step / the step's seconds


def ft_run(cfg: ReplicaConfig, warmup: int, name: str = "ft") -> float:
    """Seconds per step of the torchft run with the tape after the warm-up (slowest rank).
    With the SDC check on, each rank also times its digesting and judging (the check's own
    work: its digests ride in the step's exchange, which runs either way): SDC_SHARE."""
    with tempfile.TemporaryDirectory() as d:
        res = record(Path(d) / "run.tape", cfg, transport="processes")
    ranks = [r for r in res.ranks.values() if len(r.get("commit_times", ())) == cfg.steps]
    if len(ranks) != len(cfg.groups):  # a rank a slow start left out healed later: its early steps are missing
        ranks = [r for r in res.ranks.values() if len(r.get("commit_times", ())) > warmup + 2]
    per = max(_per_step(r["commit_times"], warmup) for r in ranks)
    slowest = max(ranks, key=lambda r: _per_step(r["commit_times"], warmup))
    PARTS_LOG.setdefault(name, []).append(_mean_parts(slowest["parts"], warmup))
    if cfg.sdc:
        t = [r["commit_times"] for r in ranks]
        SDC_SHARE.append(max(r["sdc_s"] / (c[-1] - c[0]) * (len(c) - 1) / len(c) for r, c in zip(ranks, t)))
    return per


def _parts_table(size: str, names: list[str], times: dict[str, list[float]]) -> None:
    """Each part's mean ms per step (median over the rounds) and its share of that run's step."""
    from runs.replicas.timing import PARTS

    ddp = statistics.median(times["ddp"]) if times.get("ddp") else None
    for k in names:
        rounds = PARTS_LOG.get(k, [])
        if not rounds:
            continue
        med = {p: statistics.median(r.get(p, 0.0) for r in rounds) for p in PARTS}
        total = sum(med.values())
        cells = "  ".join(f"{p} {1000 * v:.2f} ({100 * v / total:.0f}%)" for p, v in med.items() if v >= 5e-6)
        vs = f"; {total / ddp:.2f}x the DDP step {1000 * ddp:.1f} ms" if ddp and k != "ddp" else ""
        print(f"[{size}] parts of a {k} step, mean {1000 * total:.2f} ms{vs}: {cells}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=120, help="steps of a small-step run (a big-step run: a third)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--groups", type=int, default=2, help="replica groups of one rank (default: one per core here)")
    ap.add_argument("--big", type=int, default=256, help="global batch of the large step size")
    ap.add_argument("--sizes", default="small,big")
    ap.add_argument("--runs", default="ddp,ddp2,ft,ft2,ft+sdc,ftbare", help="which runs, of those named above")
    a = ap.parse_args()
    groups = tuple((f"g{i}", 1) for i in range(a.groups))
    batches = {"small": ReplicaConfig().global_batch, "big": a.big}
    os.environ.setdefault("RUST_LOG", "error")  # torchft's per-step log lines are not what is measured
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    for size in a.sizes.split(","):
        PARTS_LOG.clear()
        steps = a.steps if size == "small" else max(a.warmup + 10, a.steps // 3)
        base = ReplicaConfig(groups=groups, steps=steps, global_batch=batches[size], param_every=0, sdc=False)
        sdc = ReplicaConfig.from_dict({**base.to_dict(), "sdc": True})
        every = {"ddp": (ddp_run, base), "ddp2": (ddp_run, base), "ft": (ft_run, base), "ft2": (ft_run, base),
                 "ft+sdc": (ft_run, sdc), "ftbare": (bare_run, base)}
        wanted = a.runs.split(",")
        unknown = [k for k in wanted if k not in every]
        if unknown:
            raise SystemExit(f"unknown runs {unknown}; choose from {list(every)}")
        runs = {k: every[k] for k in every if k in wanted}
        rng = random.Random(0)
        times: dict[str, list[float]] = {k: [] for k in runs}
        print(f"== {size}: global batch {batches[size]}, {a.groups} replica groups of 1 rank, {steps} steps "
              f"({a.warmup} warm-up), {a.rounds} rounds", flush=True)
        for r in range(a.rounds):
            order = list(runs)
            rng.shuffle(order)
            for k in order:
                fn, cfg = runs[k]
                times[k].append(fn(cfg, a.warmup, k))
            print(f"round {r + 1}/{a.rounds}: " + "  ".join(f"{k} {1000 * times[k][-1]:.1f}" for k in runs)
                  + f" ms/step (load {os.getloadavg()[0]:.2f})", flush=True)

        def ratio(x: str, y: str) -> str:
            rs = [times[x][i] / times[y][i] - 1 for i in range(a.rounds)]
            return f"{100 * statistics.median(rs):+.1f}% (rounds {100 * min(rs):+.1f}%..{100 * max(rs):+.1f}%)"

        print("median step time: " + ", ".join(f"{k} {1000 * statistics.median(v):.1f} ms" for k, v in times.items()))
        if "ft" in runs and "ddp" in runs:
            print(f"[{size}] torchft + tape vs plain DDP (same groups, no faults): {ratio('ft', 'ddp')} "
                  f"(target <= {100 * TARGET_FT:.0f}%)")
        if "ftbare" in runs and "ddp" in runs:
            print(f"[{size}] torchft alone vs plain DDP (its quorum and should_commit RPCs): {ratio('ftbare', 'ddp')}")
        if "ft" in runs and "ftbare" in runs:
            print(f"[{size}] torchft + tape vs torchft alone (what this run adds): {ratio('ft', 'ftbare')}")
        if "ddp2" in runs and "ddp" in runs:
            print(f"[{size}]   A/A control, DDP vs itself: {ratio('ddp2', 'ddp')}")
        if "ft+sdc" in runs and "ft" in runs:
            print(f"[{size}] SDC cross-replica check per step, run vs run: {ratio('ft+sdc', 'ft')} "
                  f"(target <= {100 * TARGET_SDC:.0f}%)")
        if "ft2" in runs and "ft" in runs:
            print(f"[{size}]   A/A control, torchft vs itself: {ratio('ft2', 'ft')}")
        if "ft+sdc" in runs:
            share = SDC_SHARE[-a.rounds:]
            print(f"[{size}] SDC check's own time per step, timed in the ranks: {100 * statistics.median(share):.2f}% "
                  f"of the step (rounds {100 * min(share):.2f}%..{100 * max(share):.2f}%; target <= "
                  f"{100 * TARGET_SDC:.0f}%)", flush=True)
        _parts_table(size, list(runs), times)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
