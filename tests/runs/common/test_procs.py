"""runs.common.procs: the one launcher of the runs' worker processes and threads."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from replay.watchdog import hang_bound
from runs.common.procs import Threads, Workers, join_gloo, leave_gloo, serve_store


def _threads_then_exit(code: int) -> None:  # a child: exits ``code`` when it runs with one intra-op thread
    import torch

    os._exit(code if torch.get_num_threads() == 1 else 99)


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_forever(ev: object) -> None:
    ev.wait()  # type: ignore[attr-defined]


def _gloo_rank(rank: int, port: int, served: object = None) -> None:
    import torch
    import torch.distributed as dist

    store = join_gloo(rank, 2, port, timeout_s=hang_bound(12), store=served)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert float(t) == 3.0
    store.set(f"sum{rank}", "3")
    leave_gloo()


@pytest.mark.slow
def test_workers_report_exit_codes_join_one_gloo_world_and_kill_what_outlives_the_run() -> None:
    served = serve_store(timeout_s=hang_bound(12))
    port = served.port
    with Workers() as w:
        gate = w.ctx.Event()
        w.start("r1", _gloo_rank, 1, port)
        w.start("done", _threads_then_exit, 0)
        w.start("failed", _threads_then_exit, 3)
        w.start("killed", _sigkill_self)
        w.start("stuck", _wait_forever, gate)
        with pytest.raises(ValueError, match="already started"):
            w.start("done", _threads_then_exit, 0)
        _gloo_rank(0, port, served)  # rank 0 here: the world forms over the store this process serves
        for name in ("r1", "done", "failed", "killed"):
            w[name].join(hang_bound(12))
            assert w[name].exitcode is not None, f"HANG: worker {name} had not exited (a hang bound)"
        codes = w.exitcodes()
        assert codes == {"r1": 0, "done": 0, "failed": 3, "killed": -signal.SIGKILL, "stuck": None}
        assert sorted(w.failed()) == ["failed", "killed"] and not w.ended("stuck")
    assert w.exitcodes()["stuck"] == -signal.SIGKILL  # leaving the block killed and reaped it


def test_threads_reraise_the_first_error_and_name_the_stuck_ones() -> None:
    seen: list[str] = []
    t = Threads(on_error=lambda name, e: seen.append(name))
    t.start("ok", lambda: None)
    t.start("bad", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        t.join(hang_bound(6))
    assert seen == ["bad"]
    gate = threading.Event()
    t = Threads()
    t.start("slow", gate.wait)
    with pytest.raises(TimeoutError, match=r"learners did not finish: \['slow'\]"):
        t.join(0.01, what="learners")
    gate.set()
    t.join(hang_bound(6))
