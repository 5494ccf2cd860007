"""The run with real processes: ctl in this process, every worker in its own, all on one
torch.distributed gloo group, each channel a ``TorchDistTransport`` one (spec/stages.md §1).

Each process records its own tape (``run_dir/tapes/<actor>.tape``, one writer per tape,
spec/tape-format.md §2.1), all with one run id; when every process has closed its tape the
job tape ``run_dir/run.tape`` is merged from them (``replay.merge_tapes``). Snapshot parts
report to ctl over the group's own c10d store (``TorchStoreControl``).

An outage is simulated inside a live process: a gloo world is fixed when the group forms,
so the offline worker stays in the group, neither computes nor sends (``tape check``
verifies it), and rejoins with its state replaced from a peer through a checkpoint.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any, Callable

from replay import merge_tapes
from replay.channel import Endpoint, RecorderSink, TorchDistTransport
from replay.snapshot import TorchStoreControl
from runs.common.procs import Workers, join_gloo, leave_gloo, serve_store, worker_threads
from runs.stages.config import StagesConfig
from runs.stages.ctl import Controller
from runs.stages.wiring import RunOutcome, make_agent, open_recorder
from runs.stages.worker import Worker

__all__ = ["run_processes"]

def _join(cfg: StagesConfig, rank: int, port: int, store: Any = None) -> Any:
    # A receiver thread waits on gloo with the group's timeout, and a bypass channel idles
    # for most of the run: the timeout must exceed the whole run (the endpoints' own
    # receive timeouts catch a silent peer).
    store = join_gloo(rank, len(cfg.actors), port, timeout_s=max(3600.0, 10 * cfg.io_timeout_s),
                      store_timeout_s=cfg.io_timeout_s, store=store)
    inbound, outbound = cfg.neighbours(cfg.actors[rank])
    return store, TorchDistTransport(cfg.actors, inbound=inbound, outbound=outbound)


def _worker_proc(rank: int, port: int, cfg_d: dict[str, Any], run_dir: str, run_id: bytes) -> None:  # pragma: no cover - child
    cfg = StagesConfig.from_dict(cfg_d)
    name = cfg.actors[rank]
    store, transport = _join(cfg, rank, port)
    rec = open_recorder(Path(run_dir) / "tapes" / f"{name}.tape", cfg, actor=name, run_id=run_id)
    sink = RecorderSink(rec)
    ep = Endpoint(transport, sink=sink)
    w = Worker(cfg, name, ep, sink.actor(name), run_dir)
    agent = make_agent(cfg, ep, w.entries(), run_dir, TorchStoreControl(store, prefix="stages/"))
    w.run()
    agent.close()
    transport.close(timeout=cfg.io_timeout_s)
    rec.close()
    leave_gloo()


def run_processes(cfg: StagesConfig, run_dir: str | os.PathLike[str], *,
                  on_step: Callable[[int], None] | None = None) -> Any:
    worker_threads()
    t0 = time.monotonic()
    run_dir = Path(run_dir)
    tapes = run_dir / "tapes"
    tapes.mkdir(parents=True, exist_ok=False)
    run_id = secrets.token_bytes(16)
    served = serve_store(timeout_s=cfg.io_timeout_s)  # the rendezvous, held until the run ends
    port = served.port
    # the progress watchdog: each worker beats at every plan; a stall dumps every
    # process's stacks to run_dir/watchdog/ and the run fails naming it
    workers = Workers(watch=run_dir / "watchdog", quiet_s=cfg.io_timeout_s / 10, name="ctl")
    for rank, name in enumerate(cfg.actors):
        if rank > 0:
            workers.start(name, _worker_proc, rank, port, cfg.to_dict(), str(run_dir), run_id)
    try:
        store, transport = _join(cfg, 0, port, served)
        with open_recorder(tapes / "ctl.tape", cfg, actor="ctl", run_id=run_id) as rec:
            sink = RecorderSink(rec)
            ep = Endpoint(transport, sink=sink)
            ctl = Controller(cfg, ep, sink.actor("ctl"), on_step=on_step)
            ctl.agent = make_agent(cfg, ep, {"ctl": ctl.state}, run_dir, TorchStoreControl(store, prefix="stages/"))
            try:
                res = ctl.run()
            except BaseException as e:
                workers.check()  # the watchdog fired and killed the workers: the hang is the cause
                raise e
            ctl.agent.close()
            transport.close(timeout=cfg.io_timeout_s)  # a barrier over the channel graph: every worker is done
        codes = workers.join()  # on their exits; a worker that never exits is a hang the watchdog names
        bad = {n: c for n, c in codes.items() if c != 0}
        if bad:
            raise RuntimeError(f"worker processes failed: {bad}")
    finally:
        workers.close()
        leave_gloo()
    paths = [tapes / f"{a}.tape" for a in cfg.actors]
    merge_tapes(paths, run_dir / "run.tape")
    out = RunOutcome(res, None, str(run_dir), wall_s=time.monotonic() - t0)
    out.extra["process_tapes"] = [str(p) for p in paths]
    out.extra["exitcodes"] = codes
    return out
