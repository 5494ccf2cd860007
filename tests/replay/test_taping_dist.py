"""Three gloo processes run the bank with RecorderSink, each writing its own tape (one
writer per tape: spec/tape-format.md §2.1), and take two overlapping snapshots as ckpt
checkpoints. ``ckpt tape check r0.tape r1.tape r2.tape`` then checks the job's history as
one: clean, while any tape alone lacks the sends its receives need."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.replay._bank import INITIAL, Teller
from tests.replay._gloo import spawn_world as _spawn
import hangs

HANG = hangs.hang_s(3)  # a hang bound for a wait on peers or threads (tests/hangs.py), never a speed verdict

WORLD = 3
STEPS = 50
SNAPS = {"t-a": (0, 15), "t-b": (1, 18)}  # name -> (initiator rank, at step)
NAMES = [f"r{i}" for i in range(WORLD)]


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
                          control=TorchStoreControl(store, "taping/"), participants=NAMES, deadline_s=HANG)
    handles = {}
    while teller.steps < STEPS or agent.in_flight() or not all(agent.local_done(n) for n in SNAPS):
        for name, (who, at) in SNAPS.items():
            if who == rank and teller.steps == at and name not in handles:
                handles[name] = agent.initiate(name)
        teller.step(ep)
        if rank % 2:
            time.sleep(0.001)  # uneven speeds: more interleavings than lockstep
        assert teller.steps < 20_000, "snapshots never completed"
    outcomes = {n: h.wait(HANG) for n, h in handles.items()}
    agent.close()
    dist.barrier()
    ep.close(HANG)
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
