"""The CUDA benchmarks, in one run (issue 27 item 4): kept ready for a GPU machine.

On a machine without CUDA it prints one line saying so and exits 0 (the suite checks
that, and that this file compiles). With CUDA, every figure is a median of paired ratios
against a peer measured side by side in the same run, interleaved (the order reverses
every round), for >= 7 rounds, with an A/A control and the load average, as in
bench/save_load.py:

- ``stall``  the D2H stall of an async save: how long ``CheckpointManager.save`` blocks
             the loop with ``async_save=True`` (state_dict calls, RNG capture, the copy of
             every CUDA tensor into reused pinned staging), against one ``copy_`` of the
             same tensors into a pre-allocated pinned host buffer with
             ``non_blocking=True`` and a synchronize: the PCIe floor. Target <= 1.3x.
- ``save``   a durable save of a CUDA state of ``--sizes-gib`` (default 1,8): ``ckpt.save``
             against ``torch.save`` + fsync and ``torch.distributed.checkpoint.save``
             (single process); the D2H copy is part of every contender.
- ``load``   loading it back onto the GPU: ``ckpt.load`` into existing CUDA tensors
             (verified), ``ckpt.open().state(map_location="cuda")`` into fresh ones,
             against ``torch.load(map_location="cuda", weights_only=True)`` + copy_ and
             DCP ``load`` in place.
- ``rng``    the CUDA RNG round trip: every device's generator state saved, the streams
             advanced, the checkpoint loaded; the states must come back equal and the next
             draws identical (exact, not timed: printed as ok / FAILED, exit 1 if failed).

Usage: python bench/gpu.py [--rounds 7] [--sizes-gib 1,8] [--rows stall,save,load,rng]
       [--dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GiB = 1 << 30
ROWS = ("stall", "save", "load", "rng")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per row (>= 7)")
    ap.add_argument("--sizes-gib", default="1,8", help="state sizes for the save and load rows, in GiB")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"which rows to run, of {','.join(ROWS)}")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir next to the repo)")
    args = ap.parse_args(argv)
    if args.rounds < 7:
        ap.error("--rounds must be >= 7 (medians of paired ratios need them)")
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        ap.error(f"unknown rows {sorted(unknown)}; choose from {','.join(ROWS)}")
    return args


# --- measuring (the conventions of bench/save_load.py) ---------------------------------------
def paired(a: list[float], b: list[float]) -> float:
    """Median over rounds of a[i] / b[i]."""
    return statistics.median(x / y for x, y in zip(a, b))


def interleaved(contenders: dict[str, Callable[[], Any]], rounds: int, *, before: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Each contender once per round, the order reversed every other round."""
    import torch

    times: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(rounds):
        order = list(contenders.items())
        if r % 2:
            order.reverse()
        for name, fn in order:
            if before is not None:
                before()
            gc.collect()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    return times


def print_table(title: str, times: dict[str, list[float]], ref: str, target: str, subject: str, aa: str) -> None:
    print(f"{title} (load average {os.getloadavg()[0]:.1f}); median, and median paired ratio against {ref}")
    for name, t in times.items():
        print(f"  {name:<34} {statistics.median(t) * 1e3:10.1f} ms   {paired(t, times[ref]):5.2f}x {ref}")
    print(f"  => {subject} / {ref} = {paired(times[subject], times[ref]):.2f}x ({target})   "
          f"A/A control = {paired(times[aa], times[subject]):.2f}x")


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def cuda_state(nbytes: int, n: int = 16) -> dict[str, Any]:
    import torch

    per = nbytes // n // 4
    g = torch.Generator(device="cuda").manual_seed(0)
    return {f"t{i:02d}": torch.randn(per, device="cuda", generator=g) for i in range(n)}


# --- rows --------------------------------------------------------------------------------------
def row_stall(base: str, rounds: int, nbytes: int) -> None:
    import torch

    from ckpt.manager import CheckpointManager, RetentionPolicy

    width = 4096
    layers = max(1, nbytes // 3 // (width * width * 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, width, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    tensors = [*model.state_dict().values()] + [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.is_cuda]
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    total = sum(t.numel() * t.element_size() for t in tensors)

    def pinned_copy() -> None:
        for dst, src in zip(pinned, tensors):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    run = os.path.join(base, "stall")
    mgr = CheckpointManager(run, {"model": model, "optim": opt}, async_save=True,
                            retention=RetentionPolicy(keep_last=1), signals=())
    step = [0]

    def stall() -> None:
        step[0] += 1
        mgr.save(step[0])  # returns once the state is staged; the write goes on behind

    try:
        stall()
        mgr.wait()  # the staging buffers exist from here on, as in a run's later saves
        pinned_copy()
        times = interleaved({"async save stall": stall, "pinned copy_": pinned_copy, "async save stall (A/A)": stall},
                            rounds, before=lambda: mgr.wait())
    finally:
        mgr.close()
    print(f"\n## stall: model + AdamW on the GPU, {total / GiB:.2f} GiB in {len(tensors)} tensors")
    print_table("D2H stall of an async save", times, "pinned copy_", "target <= 1.3", "async save stall", "async save stall (A/A)")
    del model, opt, tensors, pinned
    torch.cuda.empty_cache()


def row_save_load(base: str, rounds: int, nbytes: int, rows: set[str]) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    import ckpt

    state = cuda_state(nbytes)
    print(f"\n## {nbytes / GiB:.0f} GiB fp32 on the GPU in {len(state)} tensors")
    d = tempfile.mkdtemp(dir=base)

    def fresh(name: str) -> str:
        path = os.path.join(d, name)
        shutil.rmtree(path, ignore_errors=True)
        if os.path.exists(path):
            os.unlink(path)
        return path

    def ck_save() -> None:
        ckpt.save(fresh("c"), {"state": state}, step=0)

    def torch_save() -> None:
        path = fresh("t.pt")
        torch.save(state, path)
        _fsync_path(path)

    def dcp_save() -> None:
        dcp.save(dict(state), checkpoint_id=fresh("dcp"), no_dist=True)

    if "save" in rows:
        times = interleaved({"ckpt.save": ck_save, "torch.save+fsync": torch_save, "dcp.save": dcp_save,
                             "ckpt.save (A/A)": ck_save}, rounds)
        print_table("durable save of a CUDA state", times, "torch.save+fsync", "lower is better", "ckpt.save", "ckpt.save (A/A)")
        print(f"  => dcp.save / ckpt.save = {paired(times['dcp.save'], times['ckpt.save']):.2f}x")
    if "load" in rows:
        ck_save()
        torch_save()
        dcp_save()
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        c, pt, dc = os.path.join(d, "c"), os.path.join(d, "t.pt"), os.path.join(d, "dcp")

        def ck_load() -> None:
            ckpt.load(c, {"state": dst}, restore_rng=False, exactness="off")

        def ck_fresh() -> None:
            ckpt.open(c).state(map_location="cuda")

        def torch_load() -> None:
            got = torch.load(pt, map_location="cuda", weights_only=True)
            for k, v in got.items():
                dst[k].copy_(v)

        def dcp_load() -> None:
            dcp.load(dst, checkpoint_id=dc, no_dist=True)

        times = interleaved({"ckpt.load in place": ck_load, "torch.load+copy_": torch_load, "dcp.load in place": dcp_load,
                             "ckpt state() fresh": ck_fresh, "ckpt.load in place (A/A)": ck_load}, rounds)
        print_table("load onto the GPU, page cache hot", times, "torch.load+copy_", "lower is better", "ckpt.load in place",
                    "ckpt.load in place (A/A)")
        ok = all(torch.equal(dst[k], state[k]) for k in state)
        print(f"  => dcp.load / ckpt.load = {paired(times['dcp.load in place'], times['ckpt.load in place']):.2f}x; bit-exact: {ok}")
    shutil.rmtree(d, ignore_errors=True)
    del state
    torch.cuda.empty_cache()


def row_rng(base: str) -> bool:
    import torch

    import ckpt

    torch.cuda.manual_seed_all(1234)
    torch.rand(3, device="cuda")  # a stream that has been used, not a fresh seed
    path = os.path.join(tempfile.mkdtemp(dir=base), "rng")
    w = torch.zeros(4, device="cuda")
    ckpt.save(path, {"w": {"w": w}}, step=0)
    saved = [s.clone() for s in torch.cuda.get_rng_state_all()]
    want = [torch.rand(5, device=f"cuda:{i}") for i in range(torch.cuda.device_count())]
    res = ckpt.load(path, {"w": {"w": w}}, exactness="off")
    now = torch.cuda.get_rng_state_all()
    got = [torch.rand(5, device=f"cuda:{i}") for i in range(torch.cuda.device_count())]
    ok = all(torch.equal(a, b) for a, b in zip(saved, now)) and all(torch.equal(a, b) for a, b in zip(want, got))
    print(f"\n## rng: CUDA RNG round trip on {torch.cuda.device_count()} device(s): restored {list(res.restored_rng)}; "
          f"{'ok' if ok else 'FAILED'} (states equal, next draws identical)")
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"bench/gpu.py: no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}): nothing to measure")
        return 0
    rows = set(args.rows.split(","))
    sizes = [int(float(x) * GiB) for x in args.sizes_gib.split(",") if x]
    base = tempfile.mkdtemp(prefix="ckpt-gpu-bench-", dir=args.dir or os.path.dirname(ROOT))
    ok = True
    try:
        props = torch.cuda.get_device_properties(0)
        print(f"# bench/gpu.py  rounds={args.rounds}  torch {torch.__version__}  CUDA {torch.version.cuda}  "
              f"{props.name} ({props.total_memory / GiB:.0f} GiB) x{torch.cuda.device_count()}  "
              f"cores {os.cpu_count()}  load average {os.getloadavg()[0]:.1f} at start")
        if "stall" in rows:
            row_stall(base, args.rounds, sizes[0])
        if rows & {"save", "load"}:
            for n in sizes:
                row_save_load(base, args.rounds, n, rows)
        if "rng" in rows:
            ok = row_rng(base)
        print(f"\n# load average {os.getloadavg()[0]:.1f} at the end")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
