"""The recorder: the README loop, digest cadence, actors, threads, decisions."""

from __future__ import annotations

import struct
import threading
from pathlib import Path

import pytest
import torch

from replay import Recorder, TapeReader, replay
from replay.digest import module_digests, tensor_digest
from replay.errors import ReplayError


def test_readme_loop(tmp_path: Path) -> None:
    """The snippet shown in the README, verbatim apart from the data."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.MSELoss()
    loader = [(torch.tensor([i, i + 1]), torch.randn(2, 3), torch.randn(2, 1)) for i in range(0, 40, 2)]
    cfg = {"lr": 0.1}

    with Recorder.open(str(tmp_path / "run.tape"), entry_point="train:main", config=cfg) as rec:
        rec.watch(model)                        # parameter digests every 10 steps
        for step, (ids, x, y) in enumerate(loader):
            with rec.step(step):                # step begin/end + RNG digests
                rec.batch(ids)
                loss = loss_fn(model(x), y)
                loss.backward(); opt.step(); opt.zero_grad()  # noqa: E702
                rec.loss(loss)                  # exact float64 bits

    evs = list(TapeReader(tmp_path / "run.tape").events())
    params = [e for e in evs if e.kind.name == "params"]
    assert [e.step for e in params] == [0, 10]
    assert [n for n, _ in params[-1].payload["tensors"]] == [n for n, _ in module_digests(model)[1]] == [
        "weight", "bias"]
    losses = [e for e in evs if e.kind.name == "loss"]
    assert len(losses) == 20 and all(isinstance(e.payload["value"], float) for e in losses)
    batches = [e.payload["sample_ids"] for e in evs if e.kind.name == "batch"]
    assert batches[3] == [6, 7]


def test_loss_is_recorded_exactly(tmp_path: Path) -> None:
    t = torch.tensor(0.1, dtype=torch.float32)
    with Recorder.open(str(tmp_path / "l.tape"), rng_every=0) as rec:
        rec.loss(t)
        rec.loss(torch.tensor(1 / 3, dtype=torch.bfloat16))
    vals = [e.payload["value"] for e in TapeReader(tmp_path / "l.tape").events() if e.kind.name == "loss"]
    assert struct.pack("<f", vals[0]) == struct.pack("<f", t.item()) and vals[0] == float(t.item())
    assert vals[1] == torch.tensor(1 / 3, dtype=torch.bfloat16).item()


def test_param_digest_cadence_and_per_tensor_names(tmp_path: Path) -> None:
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    with Recorder.open(str(tmp_path / "p.tape"), param_digest_every=3, rng_every=0) as rec:
        rec.watch(m, prefix="net.")
        for s in range(7):
            with rec.step(s):
                pass
    ps = [e for e in TapeReader(tmp_path / "p.tape").events() if e.kind.name == "params"]
    assert [e.step for e in ps] == [0, 3, 6]
    names = [n for n, _ in ps[0].payload["tensors"]]
    assert names == ["net." + k for k in m.state_dict()]
    assert dict(ps[0].payload["tensors"])["net.0.weight"] == tensor_digest(m[0].weight)


def test_params_of_named_tensors_equal_those_of_a_module_holding_them(tmp_path: Path) -> None:
    m = torch.nn.Linear(3, 2)
    extra = torch.arange(4.0)
    named = [*(("m." + k, v) for k, v in m.state_dict().items()), ("anchor", extra)]
    with Recorder.open(str(tmp_path / "n.tape"), param_digest_every=0, rng_every=0) as rec:
        rec.params([("m.", m)])
        rec.params(named=named)
        with pytest.raises(TypeError, match="not both"):
            rec.params([("m.", m)], named=named)
    a, b = [e.payload for e in TapeReader(tmp_path / "n.tape").events() if e.kind.name == "params"]
    assert b["tensors"][:2] == a["tensors"] and b["tensors"][2] == ("anchor", tensor_digest(extra))


def test_tensor_digest_covers_dtype_and_shape() -> None:
    a = torch.arange(6, dtype=torch.float32)
    assert tensor_digest(a) != tensor_digest(a.view(2, 3))
    assert tensor_digest(a) != tensor_digest(a.view(torch.int32))
    assert tensor_digest(a[::2]) == tensor_digest(a[::2].contiguous())
    assert tensor_digest(torch.tensor(1.0, dtype=torch.bfloat16)) != tensor_digest(torch.tensor(1.0))


def test_rng_sources_and_cadence(tmp_path: Path) -> None:
    with Recorder.open(str(tmp_path / "r.tape"), rng_every=2, rng_sources=("torch",)) as rec:
        for s in range(4):
            with rec.step(s):
                torch.rand(1)
    rng = [e for e in TapeReader(tmp_path / "r.tape").events() if e.kind.name == "rng"]
    assert [(e.step, e.payload["source"]) for e in rng] == [(0, "torch"), (2, "torch")]
    assert rng[0].payload["digest"] != rng[1].payload["digest"]


def test_actor_clocks_and_channel_numbering(tmp_path: Path) -> None:
    with Recorder.open(str(tmp_path / "a.tape"), rng_every=0) as rec:
        a = rec.actor("a")
        assert rec.actor("a") is a
        s1 = a.send("c", b"1", peer="main")
        s2 = a.send("c", b"2", peer="main")
        s3 = a.send("d", b"3", peer="main")
        assert [(s.channel, s.chan_seq) for s in (s1, s2, s3)] == [("c", 1), ("c", 2), ("d", 1)]
        rec.recv(s2)
        assert rec.clock.as_dict() == {"a": 2, "main": 1}
        rec.recv(s1)  # out of order delivery still merges correctly
        assert rec.clock.as_dict() == {"a": 2, "main": 2}


def test_threads_share_one_tape_and_replay_per_actor(tmp_path: Path) -> None:
    path = tmp_path / "th.tape"

    def body(rec: Recorder) -> None:
        def learner(i: int) -> None:
            me = rec.actor(f"l{i}")
            for s in range(50):
                me.current_step = s
                me.metric("x", i * 1000 + s)

        for i in range(4):
            rec.actor(f"l{i}")  # declare in a fixed order: actor ids are part of the bytes
        ts = [threading.Thread(target=learner, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    with Recorder.open(str(path), rng_every=0) as rec:
        body(rec)
    evs = [e for e in TapeReader(path).events() if e.kind.name == "metric"]
    assert len(evs) == 200
    for i in range(4):
        mine = [e for e in evs if e.actor == f"l{i}"]
        assert [e.payload["value"] for e in mine] == [float(i * 1000 + s) for s in range(50)]
        assert [e.clock[f"l{i}"] for e in mine] == list(range(1, 51))
    # replay with another interleaving: per-actor comparison makes it identical
    import replay.replayer as rp

    reader = TapeReader(path)
    oracle = rp.Oracle(reader)
    r = Recorder(None, oracle=oracle, mode="verify")
    body(r)
    oracle.finish()
    assert oracle.divergence is None and oracle.compared == 200


def test_decisions_return_same_shape_in_record_and_force(tmp_path: Path) -> None:
    path = tmp_path / "d.tape"
    with Recorder.open(str(path), rng_every=0) as rec:
        v = rec.decide("order", "k", lambda: (3, 1, 2))
        assert v == [3, 1, 2]  # msgpack image: what force mode would return
        assert rec.maybe_inject("crash", "l1", lambda: False) is False
        assert rec.maybe_inject("crash", "l2", lambda: {"at": 5}) == {"at": 5}
    kinds = [e.kind.name for e in TapeReader(path).events()]
    assert kinds.count("decision") == 3 and kinds.count("fault_injected") == 1


def test_recorder_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        Recorder(None, mode="play")
    with pytest.raises(ValueError, match="exactly one of"):
        Recorder(None, mode="verify")
    with Recorder.open(str(tmp_path / "x.tape")) as rec:
        assert rec.replaying is False and rec.mode == "record"
    with pytest.raises(FileExistsError):
        Recorder.open(str(tmp_path / "x.tape"))
    with pytest.raises(ReplayError, match="no entry point"):
        replay(tmp_path / "x.tape")


def test_checkpoint_marker_always_fsyncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Recorder.open(str(tmp_path / "c.tape"), rng_every=0) as rec:
        assert rec.writer is not None
        calls: list[int] = []
        real = rec.writer.sync
        monkeypatch.setattr(rec.writer, "sync", lambda: (calls.append(1), real())[1])
        rec.note("before")
        assert calls == []
        rec.checkpoint("ck", "/p")
        assert calls == [1]


def test_public_names_exist() -> None:
    import replay

    for name in replay.__all__:
        assert getattr(replay, name) is not None, name
    assert len(set(replay.__all__)) == len(replay.__all__)


def test_decide_takes_the_map_keys_the_tape_allows(tmp_path: Path) -> None:
    """spec/tape-format.md §6.1.1 allows integer map keys (besides strings) in a msgpack
    field; decide() crashed on them (a strict str-key round trip) before taping."""
    from replay import Recorder
    from replay.tape import TapeReader

    value = {1: "a", -7: [1, 2], "s": {3: (4, 5)}}
    tape = tmp_path / "k.tape"
    with Recorder.open(str(tape), rng_every=0) as rec:
        assert rec.decide("route", "k", lambda: value) == {1: "a", -7: [1, 2], "s": {3: [4, 5]}}
    (ev,) = [e for e in TapeReader(tape).events() if e.kind.name == "decision"]
    assert ev.payload["value"] == {1: "a", -7: [1, 2], "s": {3: [4, 5]}}
