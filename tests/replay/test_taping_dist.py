"""Three gloo processes run the bank with RecorderSink, each writing its own tape (one
writer per tape: spec/tape-format.md §2.1), and take two overlapping snapshots as ckpt
checkpoints. ``ckpt tape check r0.tape r1.tape r2.tape`` then checks the job's history as
one: clean, while any tape alone lacks the sends its receives need."""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import msgpack
import pytest
import torch
from click.testing import CliRunner

from tests.replay._bank import INITIAL, Teller

WORLD = 3
STEPS = 50
SNAPS = {"t-a": (0, 15), "t-b": (1, 18)}  # name -> (initiator rank, at step)
NAMES = [f"r{i}" for i in range(WORLD)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world, store, Path(out))
        result["ok"] = True
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
    Path(out, f"result-{rank}.msgpack").write_bytes(msgpack.packb(result, use_bin_type=True))
    os._exit(0)  # skip destroy_process_group; the OS reclaims the sockets


def _spawn(fn: Callable[..., Any], world: int, out: Path, timeout: float) -> list[dict[str, Any]]:
    ctx = torch.multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, str(out)), daemon=True) for r in range(world)]
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
    for r in range(world):
        res = msgpack.unpackb(Path(out, f"result-{r}.msgpack").read_bytes(), raw=False, strict_map_key=False)
        assert res.get("ok"), f"rank {r} failed:\n{res.get('error')}"
        results.append(res)
    return results


def _worker(rank: int, world: int, store: Any, out: Path) -> dict[str, Any]:
    import torch.distributed as dist

    from replay import Recorder
    from replay.channel import Endpoint, RecorderSink, TorchDistTransport
    from replay.snapshot import CkptSnapshotStore, SnapshotAgent, TorchStoreControl

    me = NAMES[rank]
    if rank == 0:
        store.set("taping/run_id", os.urandom(16))
    run_id = bytes(store.get("taping/run_id"))  # one job, one run id on every process's tape
    rec = Recorder.open(str(out / f"{me}.tape"), actor=me, rng_every=0, run_id=run_id, commit="test")
    teller = Teller(4321 + rank)
    ep = Endpoint(TorchDistTransport(NAMES, tag=31), sink=RecorderSink(rec, endpoint_steps=True),
                  step=lambda: teller.steps)
    agent = SnapshotAgent(ep, {"teller": teller}, store=CkptSnapshotStore(out / "snaps"),
                          control=TorchStoreControl(store, "taping/"), participants=NAMES, deadline_s=60)
    handles = {}
    while teller.steps < STEPS or agent.in_flight() or not all(agent.local_done(n) for n in SNAPS):
        for name, (who, at) in SNAPS.items():
            if who == rank and teller.steps == at and name not in handles:
                handles[name] = agent.initiate(name)
        teller.step(ep)
        if rank % 2:
            time.sleep(0.001)  # uneven speeds: more interleavings than lockstep
        assert teller.steps < 20_000, "snapshots never completed"
    outcomes = {n: h.wait(60) for n, h in handles.items()}
    agent.close()
    dist.barrier()
    ep.close(30)
    rec.close()  # after the agent: its coordinator thread tapes the outcome
    return {"outcomes": {n: [o.committed, o.reason] for n, o in outcomes.items()}, "balance": int(teller.balance)}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_gloo_per_process_tapes_check_clean(tmp_path: Path) -> None:
    from ckpt_cli.main import cli
    from replay.clock import VectorClock
    from replay.snapshot import CHANNELS_KEY, CkptSnapshotStore
    from replay.tape import TapeReader

    res = _spawn(_worker, WORLD, tmp_path, timeout=120)
    for name, (who, _) in SNAPS.items():
        assert res[who]["outcomes"][name] == [True, ""]
    tapes = [str(tmp_path / f"{a}.tape") for a in NAMES]
    run = CliRunner().invoke(cli, ["tape", "check", *tapes], catch_exceptions=False)
    assert run.exit_code == 0, run.output
    assert run.output == f"ok: {' '.join(tapes)}: no invariant violated\n"
    alone = CliRunner().invoke(cli, ["tape", "check", tapes[1]], catch_exceptions=False)
    assert alone.exit_code == 6 and "[recv-without-send]" in alone.output  # the sends live on the other tapes

    readers = [TapeReader(t) for t in tapes]
    assert len({r.run_id for r in readers}) == 1
    evs = [e for r in readers for e in r.events()]
    assert {e.actor for e in evs if e.kind.name != "actor"} == set(NAMES)
    store = CkptSnapshotStore(tmp_path / "snaps")
    for name in SNAPS:
        meta = store.read_meta(name)
        assert meta["parts"] == NAMES
        total = 0
        for a in NAMES:
            (cut,) = [e for e in evs if e.actor == a and e.kind.name == "snapshot" and e.payload["snapshot_id"] == name]
            (ch,) = [e for e in evs if e.actor == a and e.kind.name == "snapshot_channels"
                     and e.payload["snapshot_id"] == name]
            assert VectorClock.decode(meta["cut"][a]) == cut.clock  # the part's cut is the taped one
            recorded = store.read_entry(name, a, CHANNELS_KEY)
            assert sorted(tuple(r) for r in ch.payload["inflight"]) == sorted(
                (f"{src}->{a}", m["seq"] + 1) for src, msgs in recorded.items() for m in msgs)
            total += int(store.read_entry(name, a, "teller")["balance"])
            total += sum(int(m["tensors"][0]) for msgs in recorded.values() for m in msgs)
        assert total == INITIAL * WORLD
    assert store.pending_leftovers() == []
