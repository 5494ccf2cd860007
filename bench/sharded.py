"""Sharded save/load benchmark: ckpt.dcp against DCP's default filesystem storage.

4 gloo ranks each hold ``--state-mib`` of FSDP2 state (parameters + AdamW exp_avg and
exp_avg_sq, a third each). Side by side, interleaved, in the same processes, every round:

- save:  ``ckpt.save`` (our format through DCP, chunk digests and fsync included)
         vs ``dcp.save`` with its default ``FileSystemWriter`` (fsync on), same state;
- load with reshard 4 -> 2: a second job of 2 ranks loads each checkpoint into its own
         FSDP2 shards: ``ckpt.load`` (verifying every chunk it reads) vs ``dcp.load``
         with ``FileSystemReader`` (no verification exists there), both followed by
         ``set_state_dict``.

Each figure is the median over rounds of the paired ratio ckpt / DCP (< 1.0: ckpt faster);
a round's time is the slowest rank's (the collective ends when the slowest is done).
Targets: save <= 1.0x, load-with-reshard <= 1.0x.

Usage: python bench/sharded.py [--state-mib 256] [--rounds 5] [--dir DIR]
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

from runs.common.procs import join_gloo, serve_store  # noqa: E402  (torch-free)

MiB = 1 << 20
WIDTH = 1024  # one layer: WIDTH x WIDTH float32 = 4 MiB


def _build(world: int, state_mib: int) -> tuple:
    """The model sized so that 4 ranks hold ``state_mib`` each (params / 4 x 3 tensors)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = max(1, round(state_mib * 4 / 3 * MiB / (WIDTH * WIDTH * 4)))
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for p in m.parameters():  # materialise AdamW state without a forward pass
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad()
    return m, opt


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()  # the slowest rank ends the round
    return time.perf_counter() - t0


def _drop(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _save_job(rank: int, world: int, port: int, args: argparse.Namespace, q) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ckpt

    torch.set_num_threads(1)
    join_gloo(rank, world, port, timeout_s=1800)  # the store _run serves
    m, opt = _build(world, args.state_mib)
    rows = []
    for r in range(args.rounds):
        ours, ref = os.path.join(args.dir, f"ckpt-{r}"), os.path.join(args.dir, f"dcp-{r}")

        def save_ours() -> None:
            ckpt.save(ours, {"model": m, "optim": opt}, step=r)

        def save_dcp() -> None:
            msd, osd = get_state_dict(m, opt)
            dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(ref))

        pair = [("ckpt", save_ours), ("dcp", save_dcp)]
        if r % 2:
            pair.reverse()  # alternate who goes first
        t = {name: _timed(fn) for name, fn in pair}
        rows.append(t)
        if rank == 0 and r < args.rounds - 1:  # keep the last pair for the load job
            _drop(ours)
            _drop(ref)
        dist.barrier()
    if rank == 0:
        local = sum(p.to_local().numel() * 4 * 3 for p in m.parameters())
        q.put({"save": rows, "per_rank_state_bytes": local})
    dist.destroy_process_group()


def _load_job(rank: int, world: int, port: int, args: argparse.Namespace, q) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import ckpt

    torch.set_num_threads(1)
    join_gloo(rank, world, port, timeout_s=1800)  # the store _run serves
    # Same global shapes as the saving job (sized for 4 ranks), sharded over 2.
    m, opt = _build(world, args.state_mib)
    last = args.rounds - 1
    ours, ref = os.path.join(args.dir, f"ckpt-{last}"), os.path.join(args.dir, f"dcp-{last}")
    rows = []
    import warnings

    warnings.simplefilter("ignore")
    for r in range(args.rounds):

        def load_ours() -> None:
            ckpt.load(ours, {"model": m, "optim": opt}, exactness="off")

        def load_dcp() -> None:
            msd, osd = get_state_dict(m, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, storage_reader=dcp.FileSystemReader(ref))
            set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

        pair = [("ckpt", load_ours), ("dcp", load_dcp)]
        if r % 2:
            pair.reverse()
        rows.append({name: _timed(fn) for name, fn in pair})
    if rank == 0:
        q.put({"load": rows})
    dist.destroy_process_group()


def _run(target, world: int, args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # the rendezvous, served here on the port the OS gave it as it listened (held until the
    # ranks are done): a port found free and handed over could be taken in between
    served = serve_store(timeout_s=1800)
    port = served.port
    procs = [ctx.Process(target=target, args=(r, world, port, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    import queue

    while True:  # a rank that fails never reports: stop instead of waiting forever
        try:
            out = q.get(timeout=2)
            break
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit(f"a rank of {target.__name__} failed")
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a rank of {target.__name__} exited with {p.exitcode}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-mib", type=int, default=256, help="FSDP2 state per rank when saving on 4 ranks")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    own = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="bench-sharded-")
    try:
        s = _run(_save_job, 4, args)
        l_ = _run(_load_job, 2, args)
    finally:
        if own:
            shutil.rmtree(args.dir, ignore_errors=True)

    def summary(rows: list[dict]) -> dict:
        ratios = [row["ckpt"] / row["dcp"] for row in rows]
        return {
            "ratio_median": statistics.median(ratios),
            "ratios": [round(x, 3) for x in ratios],
            "ckpt_s_median": statistics.median(row["ckpt"] for row in rows),
            "dcp_s_median": statistics.median(row["dcp"] for row in rows),
        }

    report = {
        "ranks": 4,
        "per_rank_state_mib": round(s["per_rank_state_bytes"] / MiB, 1),
        "rounds": args.rounds,
        "save_vs_dcp": summary(s["save"]),
        "load_reshard_4_to_2_vs_dcp": summary(l_["load"]),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
