"""A gloo world of real processes for the replay tests: every rank runs ``fn(rank, world,
store, out, *args)`` in a spawned process and writes its result map; the parent collects
them (a rank expected to be SIGKILLed reports nothing).

The ranks run under the progress watchdog (``runs.common.procs.Workers``): no wait judges
speed, and a world that stops making progress fails with every rank's stacks."""

from __future__ import annotations

import datetime
import os
import signal
import traceback
from pathlib import Path
from typing import Any, Callable

import msgpack

__all__ = ["spawn_world"]


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, out: str, args: tuple) -> None:
    import torch.distributed as dist

    from replay.watchdog import beat, hang_bound

    result: dict[str, Any] = {}
    try:
        beat("joining gloo")
        # bounds for a rendezvous and a collective: hang bounds (a loaded machine starts slowly)
        bound = datetime.timedelta(seconds=hang_bound(6.0))
        # the store the parent serves (spawn_world): every rank is a client
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=bound)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=bound)
        beat("running the test's function")
        result = fn(rank, world, store, Path(out), *args)
        result["ok"] = True
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
    Path(out, f"result-{rank}.msgpack").write_bytes(msgpack.packb(result, use_bin_type=True))
    # Skip destroy_process_group: with a dead peer it may block; the OS reclaims sockets.
    os._exit(0)


def spawn_world(fn: Callable[..., Any], world: int, out: Path, *args: Any, timeout: float = 90.0,
           expect_killed: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """``timeout``: the world's time on a quiet machine, many times over; no progress (a
    heartbeat, an exit) for a tenth of it, times the hang scale, is a hang."""
    from replay.errors import HangError
    from replay.watchdog import hang_bound
    from runs.common.procs import Workers, serve_store

    # the world's rendezvous, served here on a port the OS assigned as it listens (a port
    # found free, closed and bound later by rank 0 could be taken in between)
    served = serve_store(timeout_s=hang_bound(6.0))
    port = served.port
    with Workers(watch=Path(out) / "watchdog", stall_s=hang_bound(timeout / 10), name="test") as w:
        w.watchdog.progress = lambda: tuple(w.exitcodes().values())
        for r in range(world):
            w.start(f"rank{r}", _child, fn, r, world, port, str(out), args)
        try:
            w.join()
        except HangError as e:
            raise AssertionError(f"the gloo world hung: {e}\n{Path(e.report).read_text()}") from None
        procs = list(w)
    del served  # every rank has exited
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
