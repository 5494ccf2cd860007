"""Snapshots over torch.distributed (gloo, localhost, real processes).

Three spawns, shared across checks to keep the suite fast on 2 cores:
1. four tellers run the bank with arrival-order delivery (real timing nondeterminism)
   while two overlapping snapshots are taken and committed as ckpt checkpoints;
2. four fresh processes restore each snapshot in turn, force the recorded post-cut
   delivery order, finish, and must end bit-identical to the original run;
3. three processes: one is SIGKILLed mid-message; the survivors get PeerDiedError naming
   the channel and seq, a snapshot that needs the dead process aborts and leaves no
   directory, and one that may exclude it commits without it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from tests.replay._bank import INITIAL, Teller
from tests.replay._gloo import spawn_world as _spawn
import hangs

HANG = hangs.hang_s(3)  # a hang bound for a wait on peers or threads (tests/hangs.py), never a speed verdict

WORLD = 4
BANK_STEPS = 60
SNAPS = {"snap-a": (0, 20), "snap-b": (2, 24)}  # name -> (initiator rank, at step)


# -- the bank application (same rules as the in-process test) --------------------------


def _actors(world: int, prefix: str = "r") -> list[str]:
    return [f"{prefix}{i}" for i in range(world)]


def _bank_worker(rank: int, world: int, store: Any, out: Path) -> dict[str, Any]:
    import torch.distributed as dist

    from replay.channel import Endpoint, ListSink, TorchDistTransport
    from replay.snapshot import CkptSnapshotStore, SnapshotAgent, TorchStoreControl

    names = _actors(world)
    res: dict[str, Any] = {}
    res["channel"] = _channel_checks(rank, names)
    sink = ListSink()
    teller = Teller(1234 + rank)
    ep = Endpoint(TorchDistTransport(names), sink=sink, step=lambda: teller.steps)
    agent = SnapshotAgent(ep, {"teller": teller}, store=CkptSnapshotStore(out / "snaps"),
                          control=TorchStoreControl(store, "bank/"), participants=names, deadline_s=HANG)
    handles = {}
    while teller.steps < BANK_STEPS or agent.in_flight() or not all(agent.local_done(n) for n in SNAPS):
        for name, (who, at) in SNAPS.items():
            if who == rank and teller.steps == at and name not in handles:
                handles[name] = agent.initiate(name)
        teller.step(ep)
        if rank % 2:
            time.sleep(0.001)  # uneven speeds: more interleavings than lockstep
        assert teller.steps < 20_000, "snapshots never completed"
    res["outcomes"] = {n: {"committed": h.wait(HANG).committed, "reason": h.wait(HANG).reason}
                       for n, h in handles.items()}
    res["blocked_s"] = {n: agent.stats[n]["blocked_s"] for n in agent.stats}
    agent.close()
    dist.barrier()
    res["final"] = teller.final(ep)
    res["events"] = sink.to_list()
    ep.close(HANG)
    return res


def _channel_checks(rank: int, names: list[str]) -> dict[str, Any]:
    """Wire round trips and the typed errors, on their own tag (a separate transport)."""
    from replay.channel import Endpoint, TorchDistTransport
    from replay.errors import MessageTooLargeError, ReceiveTimeoutError

    out: dict[str, Any] = {}
    big_bound = 4 * 1024 * 1024
    small_bound = 1536 * 1024
    # r1 declares a smaller bound than r0 sends under: the receiver must refuse, drain
    # and stay in sync. Small chunks make multi-chunk segments cheap to exercise.
    tr = TorchDistTransport(names, tag=77, chunk_bytes=64 * 1024,
                            max_message_bytes=small_bound if rank == 1 else big_bound)
    ep = Endpoint(tr, max_message_bytes=big_bound)
    samples = _samples()
    if rank == 0:
        for i, (meta, tensors) in enumerate(samples):
            ep.send("r1", meta, tensors)
        try:
            ep.send("r1", {}, [torch.zeros(big_bound)])  # 16 MiB > 4 MiB: refused before sending
        except MessageTooLargeError as exc:
            out["send_too_large"] = str(exc)
        ep.send("r1", {"what": "oversize"}, [torch.arange(2 * 1024 * 1024 // 8, dtype=torch.int64)])
        ep.send("r1", {"what": "after"}, [torch.tensor([7, 8, 9])])
    if rank == 1:
        got = [ep.recv(timeout=HANG) for _ in samples]
        exact = []
        for m, (meta, tensors) in zip(got, samples):
            exact.append(m.meta == meta and len(m.tensors) == len(tensors)
                         and all(a.dtype == b.dtype and a.shape == b.shape
                                 and torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point and a.element_size() == 1
                                                 else a, b.view(torch.uint8) if b.dtype.is_floating_point and b.element_size() == 1 else b)
                                 for a, b in zip(m.tensors, tensors)))
        out["seqs"] = [m.seq for m in got]
        out["exact"] = exact
        out["clocks"] = [m.clock.encode() for m in got]
        try:
            ep.recv(timeout=HANG)
        except MessageTooLargeError as exc:
            out["recv_too_large"] = str(exc)
            out["recv_too_large_seq"] = exc.seq
        after = ep.recv(timeout=HANG)
        out["after"] = [after.seq, after.meta["what"], after.tensors[0].tolist()]
    if rank == 2:
        t0 = time.monotonic()
        try:
            ep.recv(timeout=0.3)
        except ReceiveTimeoutError as exc:
            out["timeout"] = str(exc)
            out["timeout_waited"] = time.monotonic() - t0 >= 0.29
    ep.close(HANG)
    return out


def _samples() -> list[tuple[dict[str, Any], list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(5)
    base = torch.randn(300_000, generator=g)  # 1.2 MB: several 64 KiB chunks
    return [
        ({"k": "plain", "n": [1, 2.5, None, True], "b": b"\x00\xff"}, [base]),
        ({}, [base.to(torch.bfloat16), base[:10].to(torch.float16), (base > 0)]),
        ({"repeat": 1}, [torch.tensor(3), torch.empty(0, 5), torch.arange(12, dtype=torch.int8).reshape(3, 4)]),
        ({"repeat": 1}, [torch.tensor(3), torch.empty(0, 5), torch.arange(12, dtype=torch.int8).reshape(3, 4)]),
        ({"c": 1}, [torch.randn(4, 2, generator=g, dtype=torch.complex64), base[:16].to(torch.float8_e4m3fn),
                    base.reshape(600, 500)[:, ::7]]),  # non-contiguous input
    ]


def _restore_worker(rank: int, world: int, store: Any, out: Path) -> dict[str, Any]:
    import torch.distributed as dist

    from replay.channel import Endpoint, ForcedScheduler, ListSink, TorchDistTransport
    from replay.snapshot import CkptSnapshotStore, SnapshotAgent, TorchStoreControl, delivery_order

    # Read from a file, not passed as process arguments: spawn streams arguments through
    # a pipe that each child drains only after importing torch, which serialises startup.
    original = msgpack.unpackb((out / "original.msgpack").read_bytes(), raw=False, strict_map_key=False)
    names = _actors(world)
    me = names[rank]
    events = ListSink.from_list(e for r in original for e in r["events"])
    target = original[rank]["final"]["steps"]
    res: dict[str, Any] = {}
    for k, name in enumerate(sorted(SNAPS)):
        teller = Teller(seed=424242)  # deliberately wrong: everything must come from the snapshot
        order = ForcedScheduler(delivery_order(events, me, name))
        ep = Endpoint(TorchDistTransport(names, tag=500 + k), scheduler=order, forced_wait_s=30)
        agent = SnapshotAgent(ep, {"teller": teller}, store=CkptSnapshotStore(out / "snaps"),
                              control=TorchStoreControl(store, f"restore-{k}/"), participants=names)
        info = agent.restore(name)
        res.setdefault("inflight", {})[name] = dict(info.inflight)
        res.setdefault("restored_steps", {})[name] = teller.steps
        while teller.steps < target:
            teller.step(ep)
        res.setdefault("remaining", {})[name] = order.remaining
        res.setdefault("final", {})[name] = teller.final(ep)
        dist.barrier()
        ep.close(HANG)
        agent.close()
    return res


def _kill_worker(rank: int, world: int, store: Any, out: Path) -> dict[str, Any]:
    from replay.channel import Endpoint, ListSink, TorchDistTransport, wire
    from replay.channel.base import MessageKind
    from replay.errors import PeerDiedError
    from replay.snapshot import CkptSnapshotStore, SnapshotAgent, TorchStoreControl

    import torch.distributed as dist

    names = _actors(world, "k")
    tr = TorchDistTransport(names, tag=9)
    ep = Endpoint(tr)
    res: dict[str, Any] = {}
    if rank == 2:
        ep.send("k0", {"i": 0}, [torch.ones(4)])
        ep.send("k1", {"i": 0}, [torch.ones(4)])
        # A torn message: the header of seq 1 promises a payload that never comes.
        hdr = wire.encode_header(wire.Header(MessageKind.DATA, 1, 100, 0, 0, tr.chunk_bytes))
        tr._send_bytes(torch.frombuffer(bytearray(hdr), dtype=torch.uint8), "k0")
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    first = ep.recv(timeout=HANG)
    res["first"] = [first.seq, first.meta]
    t0 = time.monotonic()
    try:
        ep.recv(timeout=HANG)
    except PeerDiedError as exc:
        res["died"] = str(exc)
        res["died_seq"] = exc.seq
        res["died_channel"] = exc.channel
    res["detect_s"] = time.monotonic() - t0
    dist.barrier(group=dist.new_group([0, 1]))  # both survivors saw the death
    # Two snapshots that need k2: one must abort cleanly, one may exclude it.
    for k, (name, excludable) in enumerate([("needs-k2", ()), ("excludes-k2", ("k2",))]):
        sink = ListSink()
        ep2 = Endpoint(TorchDistTransport(names, tag=20 + k), sink=sink)
        agent = SnapshotAgent(ep2, {"w": torch.full((8,), float(rank))}, store=CkptSnapshotStore(out / "snaps"),
                              control=TorchStoreControl(store, f"kill-{k}/"), participants=names,
                              excludable=excludable, deadline_s=HANG, grace_s=2)
        control = TorchStoreControl(store, f"kill-{k}/")
        if rank == 0:
            h = agent.initiate(name)
            while not h.done():
                _poll(agent)
            o = h.wait(1)
            res[name] = {"committed": o.committed, "reason": o.reason, "parts": list(o.parts),
                         "excluded": list(o.excluded), "kinds": sorted({e.kind for e in sink.events})}
        else:
            end = time.monotonic() + HANG
            while control.get(f"snap/{name}/outcome") is None and time.monotonic() < end:
                _poll(agent)
        agent.close()
        dist.barrier(group=dist.new_group([0, 1]))
    return res


def _poll(agent: Any) -> None:
    from replay.errors import PeerDiedError

    try:
        agent.poll()
    except PeerDiedError:
        pass  # expected here: k2 is dead; the agent's failure handler already acted
    time.sleep(0.002)


# -- tests -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("bank")
    return out, _spawn(_bank_worker, WORLD, out, timeout=150)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_channels_over_gloo_round_trip_and_typed_errors(bank_run) -> None:
    _, res = bank_run
    r0, r1, r2 = (r["channel"] for r in res[:3])
    assert r1["exact"] == [True] * len(_samples())
    assert r1["seqs"] == list(range(len(_samples())))  # FIFO, repeated payloads stay distinct
    assert "above the declared bound of 4194304 bytes" in r0["send_too_large"]
    assert "channel r0->r1" in r0["send_too_large"] and "seq 5" in r0["send_too_large"]
    assert "above the declared bound of 1572864 bytes; dropped" in r1["recv_too_large"]
    assert "channel r0->r1" in r1["recv_too_large"] and r1["recv_too_large_seq"] == 5
    assert r1["after"] == [6, "after", [7, 8, 9]]  # drained: the channel stays usable
    assert r2["timeout_waited"] and "no message within 0.3 s" in r2["timeout"]
    assert "channel r0->r2,r1->r2,r3->r2" in r2["timeout"] and "seq 0,0,0" in r2["timeout"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_gloo_bank_conservation_and_consistency(bank_run) -> None:
    from replay.channel import ListSink
    from replay.snapshot import CHANNELS_KEY, CkptSnapshotStore, check_cut, cut_from_meta

    out, res = bank_run
    store = CkptSnapshotStore(out / "snaps")
    names = _actors(WORLD)
    events = ListSink.from_list(e for r in res for e in r["events"])
    for name, (who, _) in SNAPS.items():
        o = res[who]["outcomes"][name]
        assert o["committed"], o["reason"]
        meta = store.read_meta(name)
        assert meta["parts"] == names and store.part_names(name) == names
        total = 0
        for a in names:
            total += int(store.read_entry(name, a, "teller")["balance"])
            for msgs in store.read_entry(name, a, CHANNELS_KEY).values():
                total += sum(int(m["tensors"][0]) for m in msgs)
        assert total == INITIAL * WORLD
        assert check_cut(events, cut_from_meta(meta)) == []
    assert store.pending_leftovers() == []


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_gloo_restore_is_bit_identical_with_forced_order(bank_run, tmp_path: Path) -> None:
    out, original = bank_run
    rdir = tmp_path / "restore"
    rdir.mkdir()
    os.symlink(out / "snaps", rdir / "snaps")
    slim = [{"events": r["events"], "final": r["final"]} for r in original]
    (rdir / "original.msgpack").write_bytes(msgpack.packb(slim, use_bin_type=True))
    res = _spawn(_restore_worker, WORLD, rdir, timeout=150)
    for rank, r in enumerate(res):
        want = original[rank]["final"]
        for name in SNAPS:
            got = r["final"][name]
            assert r["remaining"][name] == 0
            assert got["balance"] == want["balance"]
            assert torch.equal(torch.frombuffer(bytearray(got["acc"]), dtype=torch.float64),
                               torch.frombuffer(bytearray(want["acc"]), dtype=torch.float64))
            assert got["rng"] == want["rng"] and got["clock"] == want["clock"]
            assert got["next_send"] == want["next_send"] and got["next_recv"] == want["next_recv"]
            assert r["restored_steps"][name] <= want["steps"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_killed_peer_raises_peer_died_and_snapshot_aborts_or_excludes(tmp_path: Path) -> None:
    res = _spawn(_kill_worker, 3, tmp_path, timeout=120, expect_killed=(2,))
    r0, r1 = res[0], res[1]
    assert r0["first"] == [0, {"i": 0}] and r1["first"] == [0, {"i": 0}]
    assert r0["died_channel"] == "k2->k0" and r0["died_seq"] == 1
    assert "peer k2 died: mid-message" in r0["died"] and "seq 1" in r0["died"]
    assert r1["died_channel"] == "k2->k1" and r1["died_seq"] == 1
    assert "peer k2 died: between messages" in r1["died"]
    a = r0["needs-k2"]
    assert not a["committed"] and "participant k2 failed before its part was durable" in a["reason"]
    assert "snapshot.abort" in a["kinds"]
    b = r0["excludes-k2"]
    assert b["committed"], b["reason"]
    assert b["parts"] == ["k0", "k1"] and b["excluded"] == ["k2"]
    assert {"snapshot.exclude", "snapshot.commit"} <= set(b["kinds"])
    snaps = tmp_path / "snaps"
    assert sorted(os.listdir(snaps)) == ["excludes-k2"]  # no leftover temporary directory
