"""A gloo world of real processes for the replay tests: every rank runs ``fn(rank, world,
store, out, *args)`` in a spawned process and writes its result map; the parent collects
them (a rank expected to be SIGKILLed reports nothing)."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import msgpack
import torch

__all__ = ["spawn_world"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, out: str, args: tuple) -> None:
    import torch.distributed as dist

    result: dict[str, Any] = {}
    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world, store, Path(out), *args)
        result["ok"] = True
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
    Path(out, f"result-{rank}.msgpack").write_bytes(msgpack.packb(result, use_bin_type=True))
    # Skip destroy_process_group: with a dead peer it may block; the OS reclaims sockets.
    os._exit(0)


def spawn_world(fn: Callable[..., Any], world: int, out: Path, *args: Any, timeout: float = 90.0,
           expect_killed: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    ctx = torch.multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, str(out), args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()  # only processes this test started, by handle
        p.join(5)
    assert not alive, f"{len(alive)} worker(s) hung past {timeout} s"
    results = []
    for r, p in enumerate(procs):
        if r in expect_killed:
            assert p.exitcode == -signal.SIGKILL, f"rank {r} exit code {p.exitcode}"
            results.append({})
            continue
        res = msgpack.unpackb(Path(out, f"result-{r}.msgpack").read_bytes(), raw=False, strict_map_key=False)
        assert res.get("ok"), f"rank {r} failed:\n{res.get('error')}"
        results.append(res)
    return results
