"""The guard's rule and its tape events, pure: the detection rule's arithmetic, and kinds
48-53 encoded by ckpt exactly as replay's one event table encodes them."""

from __future__ import annotations

import math
import struct

import pytest

from ckpt.errors import TapeFormatError, TapeLimitError
from ckpt.guard import events as gev
from ckpt.guard.rule import judge, median
from ckpt.tape.payload import pack_msgpack

D = bytes(range(16))
EDITS = ({"epoch": 0, "steps": [44, 45], "action": "skip", "delay": 0},)
RECORDS = [
    gev.Spike(True, "robust_z", 9.5, 2.25, 0.0625, 0.0926625, 78.2, 6.0, (2.25, 2.5, float("inf"))),
    gev.Spike(True, "nonfinite", float("nan"), 0.0, 0.0, 0.0, 0.0, 6.0, ()),
    gev.RollbackEvent(1, 40, "ab" * 16, "step-00000040", "skip", EDITS, ("step-00000050",), ()),
    gev.Routing("blocks.0.moe", 0, 44, 2, bytes(range(8)), gev.experts_digest(bytes(range(8)))),
    gev.RoutingReplay("blocks.0.moe", 0, 44, D),
    gev.Warmup(((0, 44), (1, 0)), (("torch_cpu", D), ("python", D[::-1]))),
    gev.Refused("limit", {"episodes": 3, "max_rollbacks": 3}),
]


def _fields(rec: object) -> tuple:
    from dataclasses import astuple

    t = astuple(rec)  # type: ignore[arg-type]
    return t[1:] if isinstance(rec, gev.Spike) else t  # "anomalous" is not taped


@pytest.mark.parametrize("rec", RECORDS, ids=lambda r: type(r).__name__)
def test_ckpt_encodes_exactly_what_the_event_table_encodes(rec: object) -> None:
    from replay.events import kind

    code, payload = gev.encode_payload(rec)  # type: ignore[arg-type]
    row = kind(code)
    values = [list(v) if isinstance(v, tuple) else v for v in _fields(rec)]
    assert row.pack(*values) == payload
    assert row.decision == (code in gev.DECISIONS)
    back = gev.decode_payload(code, payload)
    if isinstance(rec, gev.Spike) and math.isnan(rec.value):
        assert math.isnan(back.value) and back.rule == "nonfinite"  # type: ignore[union-attr]
    else:
        assert back == rec


@pytest.mark.parametrize("code,body,message", [
    (gev.SPIKE, b"", "guard event runs past its body"),
    (gev.SPIKE, gev.encode_payload(RECORDS[0])[1] + b"\x00", "guard event has 1 trailing bytes"),
    (gev.SPIKE, b"\x00\x00" + b"\x00" * 48 + struct.pack("<I", 2) + pack_msgpack([1]),
     "spike window must be an array of float64"),
    (gev.ROUTING, b"\x00\x00" + b"\x00" * 20 + struct.pack("<I", 1) + pack_msgpack(7) + D,
     "routing experts must be a msgpack bin"),
    (gev.WARMUP, struct.pack("<I", 3) + pack_msgpack([[0]]) + struct.pack("<I", 0),
     "warmup batches must be an array of [epoch, step] pairs"),
    (gev.REFUSED, b"\x00\x00" + struct.pack("<I", 0x7FFFFFFF), "msgpack length 2147483647 above"),
    (gev.REFUSED, b"\x00\x00" + struct.pack("<I", 3) + b"\xd4\x01\x00", "guard event: msgpack ext type 1 is not allowed"),
    (gev.ROLLBACK, struct.pack("<Iq", 1, 40) + b"\x00\x00" * 3 + struct.pack("<I", 1) + pack_msgpack(3)
     + b"\x00\x00\x00\x00", "rollback edits must be an array of maps"),
])
def test_hostile_payloads_are_refused(code: int, body: bytes, message: str) -> None:
    # a length above a documented limit is a TapeLimitError (spec/tape-format.md §15a), the rest TapeFormatError
    expected = TapeLimitError if " above" in message else TapeFormatError
    with pytest.raises(expected, match=message.replace("[", r"\[").replace("]", r"\]")):
        gev.decode_payload(code, body, where=" in x.tape")


def test_the_median_and_the_rule() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([4.0, 1.0, 3.0, 2.0]) == 2.5
    w = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.02]
    v = judge(2.0, w, min_history=8, z_threshold=6.0, min_scale=0.0)
    # median 1.0, MAD 0.035 -> scale 1.4826 * 0.035; z = 1.0 / that
    assert (v.median, v.mad) == (1.0, median([abs(x - 1.0) for x in w]))
    assert v.anomalous and v.rule == "robust_z" and v.score == pytest.approx(1.0 / (1.4826 * v.mad))
    assert not judge(0.2, w, min_history=8, z_threshold=6.0, min_scale=0.0).anomalous  # only upward spikes
    # a flat curve: MAD 0, the relative floor keeps noise from tripping
    flat = [1.0] * 8
    assert judge(1.001, flat, min_history=8, z_threshold=6.0, min_scale=0.01).score == pytest.approx(0.1)
    assert judge(1.07, flat, min_history=8, z_threshold=6.0, min_scale=0.01).anomalous
    # too little history: accepted, unless the loss is not finite
    assert not judge(1e9, w[:3], min_history=8, z_threshold=6.0, min_scale=0.0).anomalous
    for bad in (float("nan"), float("inf")):
        v = judge(bad, w[:3], min_history=8, z_threshold=6.0, min_scale=0.0)
        assert v.anomalous and v.rule == "nonfinite" and v.window == tuple(w[:3])
