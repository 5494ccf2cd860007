"""The event table and event encoding: every kind round-trips, floats are exact, decoders are strict."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import msgpack
import pytest

from replay.clock import VectorClock
from replay.errors import TapeFormatError
from replay.events import KIND_BY_CODE, KIND_BY_NAME, KINDS, kind
from replay.recorder import Recorder
from replay.tape import TapeReader, TapeWriter
from replay.tape.format import Frame
from replay.tape.reader import decode_event

D = bytes(range(16))
SAMPLES = {
    "actor": ("x",),
    "step_begin": (),
    "step_end": (),
    "batch": ([0, 1, 2**64 - 1],),
    "rng": ("torch", D),
    "loss": (0.1,),
    "metric": ("acc", -0.0),
    "params": (D, [("w", D), ("b", D[::-1])]),
    "send": ("c", 1, "peer", D),
    "recv": ("c", 1, "peer", D),
    "decision": ("grace", "step-3", {"in": ["a", "b"], "w": [0.5, 0.25]}),
    "quorum": ("k", 2, ["a", "b", "c"]),
    "merge": ("k", [("c", 1), ("d", 9)], [0.5, 0.5]),
    "fault_injected": ("crash", "learner-1", {"at": 3}),
    "fault_detected": ("crash", "learner-1", None),
    "fault_recovered": ("crash", "learner-1", VectorClock.of(a=2), VectorClock.of(a=3, b=1)),
    "checkpoint": ("ck-1", "/runs/a/step-1"),
    "snapshot": ("s1", [("c", 4)]),
    "note": ("héllo",),
    "snapshot_channels": ("s1", [("a->b", 3), ("c->b", 1)]),
    "snapshot_outcome": ("s1", 1, "/runs/a/s1", ["a", "b"], ["c"], ""),
    "ledger_open": ("0123456789abcdef", 40, "step-00000040", [("python", D), ("torch_cpu", D[::-1])]),
    "ledger_step": (3, D, -0.0, [("torch_cpu", D)], bytes(16)),
    "resume_check": ("exact", 41, 47, "resume verified exact over steps 41..47"),
    "ledger_values": ({"lr": 0.5, "ckpt.params_sample": D, "phase": "warmup"},),
    "step_commit": ("q-7", 1, 3, D, D[::-1]),
    "recovery_sent": ("g2.0", D, D[::-1], 4096),
    "recovery_loaded": ("g1.0", D, D[::-1]),
    "membership": ("q-7", ["g2"], ["g3"], ["g1", "g2"]),
    "data_reassign": ("redistribute", ["g3"], [5, 6, 2**64 - 1]),
    "sdc_digests": ("reduced", [("bucket-0", D), ("bucket-1", D[::-1])]),
    "sdc_verdict": ("cross-replica", 0, ["g2"], ["bucket-1"], {"step": 4}),
    "stage_down": (10, 16),
    "stage_up": ("r1.s2",),
    "bypass": ("r0.s2", "r0.s1", "r0.s3", "fwd"),
    "ef_residual": ("s2@h4", D, 12, 4096, 96),
    "stage_stall": ("wait",),
    "spike": ("robust_z", 9.5, 2.25, 0.0625, 0.0926625, 78.2, 6.0, [2.25, 2.3, float("inf")]),
    "rollback": (1, 40, "ab" * 16, "step-00000040", "skip", [{"epoch": 0, "steps": [44, 45], "action": "skip",
                                                              "delay": 0}], ["step-00000050"], []),
    "routing": ("blocks.0.moe", 0, 44, 2, bytes(range(8)), D),
    "routing_replay": ("blocks.0.moe", 0, 44, D),
    "warmup": ([[0, 44], [0, 46]], [("torch_cpu", D)]),
    "rollback_refused": ("limit", {"episodes": 3, "max_rollbacks": 3}),
}


def test_table_is_consistent() -> None:
    assert set(SAMPLES) == set(KIND_BY_NAME)
    codes = [k.code for k in KINDS]
    assert codes == sorted(codes) and len(set(codes)) == len(codes) and 0 not in codes and 0xFFFF not in codes
    assert kind("loss") is kind(6) is KIND_BY_NAME["loss"]
    with pytest.raises(KeyError, match="unknown event kind 'nope'"):
        kind("nope")
    assert {k.name for k in KINDS if k.decision} == {"decision", "quorum", "merge", "fault_injected",
                                                            "rollback", "routing"}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_kind_roundtrips(name: str) -> None:
    k = KIND_BY_NAME[name]
    raw = k.pack(*SAMPLES[name])
    got = k.unpack(raw)
    expect = dict(zip((f for f, _ in k.fields), SAMPLES[name]))
    norm = {f: [tuple(x) if isinstance(x, list) else x for x in v] if isinstance(v, list) else v
            for f, v in got.items()}
    exp_norm = {f: [tuple(x) if isinstance(x, list) else x for x in v] if isinstance(v, list) else v
                for f, v in expect.items()}
    if name in ("decision", "merge", "fault_injected"):
        norm = got
        exp_norm = expect
        exp_norm = {f: (list(map(list, v)) if f == "contributions" else v) for f, v in expect.items()}
        norm = {f: (list(map(list, v)) if f == "contributions" else v) for f, v in got.items()}
    assert norm == exp_norm
    assert k.pack_map(got) == raw  # canonical: decode then encode gives the same bytes


@pytest.mark.parametrize("value", [0.1, -0.0, float("inf"), 5e-324, 1.0000000000000002, float("nan")])
def test_floats_are_exact_bits(value: float) -> None:
    raw = KIND_BY_NAME["loss"].pack(value)
    assert raw == struct.pack("<d", value)
    back = KIND_BY_NAME["loss"].unpack(raw)["value"]
    assert struct.pack("<d", back) == struct.pack("<d", value)
    if not math.isnan(value):
        assert math.copysign(1, back) == math.copysign(1, value)


def test_nan_payload_bits_survive() -> None:
    odd_nan = struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0]
    raw = KIND_BY_NAME["loss"].pack(odd_nan)
    assert raw == bytes.fromhex("0100000000f8ff7f")


def test_decoders_are_strict() -> None:
    k = KIND_BY_NAME["batch"]
    with pytest.raises(TapeFormatError, match="count 1000 exceeds"):
        k.unpack(struct.pack("<I", 1000) + b"\0" * 8)
    with pytest.raises(TapeFormatError, match="trailing bytes after loss"):
        KIND_BY_NAME["loss"].unpack(b"\0" * 9)
    with pytest.raises(TapeFormatError, match="malformed rng payload"):
        KIND_BY_NAME["rng"].unpack(struct.pack("<H", 5) + b"ab")
    with pytest.raises(TapeFormatError, match="ext type"):
        KIND_BY_NAME["decision"].unpack(KIND_BY_NAME["note"].pack("a") + KIND_BY_NAME["note"].pack("b")
                                        + struct.pack("<I", 3) + b"\xd4\x05\x00")
    stamp = msgpack.packb(msgpack.Timestamp(5, 0))  # ext -1 never reaches an ext_hook
    with pytest.raises(TapeFormatError, match="extension value at /"):
        KIND_BY_NAME["decision"].unpack(KIND_BY_NAME["note"].pack("a") + KIND_BY_NAME["note"].pack("b")
                                        + struct.pack("<I", len(stamp)) + stamp)
    with pytest.raises(ValueError, match="digest must be 16 bytes"):
        KIND_BY_NAME["rng"].pack("torch", b"short")


def test_a_count_or_length_above_the_limits_is_a_limit_error() -> None:
    """spec/tape-format.md §15a: a length or count above §12's limits is TapeLimitError
    (it was TapeFormatError), and so in the ckpt payload reader the ledger kinds use."""
    from ckpt import errors as ce
    from ckpt.tape.payload import PayloadReader
    from replay.errors import TapeLimitError
    from replay.events import MAX_LIST, MAX_MSGPACK

    with pytest.raises(TapeLimitError, match=f"count {MAX_LIST + 1} above the limit"):
        KIND_BY_NAME["batch"].unpack(struct.pack("<I", MAX_LIST + 1) + b"\0" * 8)
    with pytest.raises(TapeLimitError, match=f"msgpack length {MAX_MSGPACK + 1} above limit"):
        KIND_BY_NAME["decision"].unpack(KIND_BY_NAME["note"].pack("a") + KIND_BY_NAME["note"].pack("b")
                                        + struct.pack("<I", MAX_MSGPACK + 1))
    with pytest.raises(ce.TapeLimitError, match="above the 1048576 limit"):
        PayloadReader(struct.pack("<I", MAX_LIST + 1), what="ledger_step").digests()
    with pytest.raises(ce.TapeLimitError, match="msgpack length"):
        PayloadReader(struct.pack("<I", MAX_MSGPACK + 1), what="ledger_step").msgpack()
    with pytest.raises(ce.TapeFormatError, match="does not fit the body"):  # short, but under the limit: format
        PayloadReader(struct.pack("<I", 1000), what="ledger_step").digests()
    with pytest.raises(TypeError, match="takes 1 fields"):
        KIND_BY_NAME["loss"].pack()


def _frame(code: int, body: bytes) -> Frame:
    return Frame(0, 0, code, memoryview(body), 0)


def test_event_decoder_refuses_bad_bodies() -> None:
    with pytest.raises(TapeFormatError, match="unknown event kind code 999"):
        decode_event(_frame(999, b"\0" * 12), [])
    with pytest.raises(TapeFormatError, match="undeclared actor id 3"):
        decode_event(_frame(2, struct.pack("<qHH", 0, 3, 0)), ["a"])
    with pytest.raises(TapeFormatError, match="non-canonical event clock"):
        decode_event(_frame(2, struct.pack("<qHHHQHQ", 0, 0, 2, 1, 1, 0, 1)), ["a", "b"])
    with pytest.raises(TapeFormatError, match="non-canonical event clock"):
        decode_event(_frame(2, struct.pack("<qHHHQ", 0, 0, 1, 0, 0)), ["a"])
    with pytest.raises(TapeFormatError, match="clock runs past the body"):
        decode_event(_frame(2, struct.pack("<qHH", 0, 0, 5)), ["a"])
    with pytest.raises(TapeFormatError, match="declared with id 4, expected 1"):
        decode_event(_frame(1, struct.pack("<qHH", 0, 4, 0) + KIND_BY_NAME["actor"].pack("b")), ["a"])


def test_recorder_writes_every_kind_and_reader_decodes_it(tmp_path: Path) -> None:
    path = tmp_path / "all.tape"
    with Recorder.open(str(path), entry_point="m:f", config={"lr": 0.1}, rng_every=0, commit="abc") as rec:
        learner = rec.actor("learner-1")
        with rec.step(0):
            rec.batch([3, 1, 2])
            rec.loss(0.25)
            rec.metric("acc", 0.5)
            stamp = learner.send("push/learner-1", b"payload", peer="main")
            rec.recv(stamp)
            rec.decide("grace", "0", lambda: {"in": ["learner-1"]})
            rec.quorum("0", 1, lambda: ["main", "learner-1"])
            rec.merge("0", lambda: ([stamp], [1.0]))
            learner.maybe_inject("crash", "learner-1", lambda: {"at": 0})
            rec.fault_detected("crash", "learner-1")
            learner.recovered("crash", "learner-1", target_clock=stamp.clock, observed=rec.clock)
            rec.snapshot("s0")
            rec.snapshot_channels("s0", [stamp])
            rec.snapshot_outcome("s0", committed=True, path="/s0", parts=["main"], excluded=["learner-1"])
            rec.checkpoint("ck0", "/x")
            rec.note("done")
            for name, values in SAMPLES.items():  # the reference runs' own kinds, through Actor.event
                if KIND_BY_NAME[name].code >= 25 and not KIND_BY_NAME[name].decision:
                    learner.event(name, *values)
            for name in ("spike", "routing_replay", "warmup", "rollback_refused"):  # encoded by ckpt.guard
                rec.record_event(name, kind(name).pack(*SAMPLES[name]))
            for name in ("rollback", "routing"):
                assert rec.decide_event(name, lambda: kind(name).pack(*SAMPLES[name])) == kind(name).pack(*SAMPLES[name])
            with pytest.raises(ValueError, match="rollback is a decision kind: use decide_event"):
                rec.record_event("rollback", kind("rollback").pack(*SAMPLES["rollback"]))
            with pytest.raises(ValueError, match="spike is not a decision kind"):
                rec.decide_event("spike", lambda: b"")
            with pytest.raises(TapeFormatError, match="malformed spike payload"):
                rec.record_event("spike", b"\x01")
    r = TapeReader(path)
    evs = list(r.events())
    names = [e.kind.name for e in evs]
    for k in KIND_BY_NAME:
        # the ledger kinds are written by ckpt.ledger, not the recorder (tests/ckpt/test_ledger.py)
        if k not in ("rng", "params", "ledger_open", "ledger_step", "resume_check"):
            assert k in names, k
    assert r.meta["config"] == {"lr": 0.1} and r.meta["commit"] == "abc" and r.meta["entry_point"] == "m:f"
    assert r.actors == ["main", "learner-1"]
    recv = next(e for e in evs if e.kind.name == "recv")
    send = next(e for e in evs if e.kind.name == "send")
    assert send.clock.happened_before(recv.clock)
    assert recv.payload == {"channel": "push/learner-1", "chan_seq": 1, "peer": "learner-1", "digest": send.payload["digest"]}
    loss = next(e for e in evs if e.kind.name == "loss")
    assert loss.payload["value"] == 0.25 and loss.step == 0
    assert [e.seq for e in evs] == list(range(len(evs)))
    for e in evs:
        assert KIND_BY_CODE[e.kind.code] is e.kind


def test_seek_by_step_uses_and_survives_the_index(tmp_path: Path) -> None:
    path = tmp_path / "s.tape"
    with Recorder.open(str(path), rng_every=0, segment_bytes=2000, buffer_bytes=4096) as rec:
        for step in range(60):
            with rec.step(step):
                rec.loss(float(step))
    r = TapeReader(path)
    full = [(e.step, e.kind.name, e.raw) for e in r.events()]
    entries = r.index()
    assert entries is not None and [e.step for e in entries] == list(range(60))
    assert len({e.segment for e in entries}) > 1
    for s in (0, 17, 59, 60):
        want = [x for x in full if x[0] >= s]
        assert [(e.step, e.kind.name, e.raw) for e in r.events(from_step=s)] == want
    # a damaged index is ignored (the tape is the authority) and can be rebuilt
    idx = r.index_path
    data = bytearray(idx.read_bytes())
    data[40] ^= 1
    idx.write_bytes(bytes(data))
    assert r.index() is None
    assert [(e.step, e.kind.name, e.raw) for e in r.events(from_step=30)] == [x for x in full if x[0] >= 30]
    assert [e.step for e in r.rebuild_index()] == list(range(60))
    assert r.index() == entries


def test_index_offsets_point_at_their_records(tmp_path: Path) -> None:
    for opts in ({}, {"zstd": True}, {"buffer_bytes": 4096}):
        path = tmp_path / f"i{len(opts)}{list(opts)}.tape"
        with TapeWriter(path, {}, **opts) as w:
            for step in range(300):
                w.note_step(step)
                w.append(2, struct.pack("<qHH", step, 0, 0) + b"x" * (step % 50))
        r = TapeReader(path)
        entries = r.index()
        assert entries is not None and len(entries) == 300
        assert all(r._entry_valid(e) for e in entries), opts
