"""spec/tape-format.md agrees with the code, and the test vectors decode as documented.

Run this file as a script to regenerate spec/vectors/tape/ (the test then checks the
bytes are reproduced exactly, so a format change cannot slip in unnoticed).
"""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from replay.errors import TapeCorruptError  # noqa: E402
from replay.events import FIELD_TYPES, KIND_BY_NAME, KINDS  # noqa: E402
from replay.tape import TapeReader  # noqa: E402
from replay.tape import format as fmt  # noqa: E402

VECTORS = ROOT / "spec" / "vectors" / "tape"
SPEC = ROOT / "spec" / "tape-format.md"
RUN_ID = bytes.fromhex("00112233445566778899aabbccddeeff")
SALT = 0x0123456789ABCDEF
META = {"entry_point": "train:main", "config": {"lr": 0.5}, "config_hash": "x", "actors": []}


def _body(step: int, actor: int, clock: list[tuple[int, int]], payload: bytes) -> bytes:
    flat = [x for e in clock for x in e]
    return struct.pack(f"<qHH{'HQ' * len(clock)}", step, actor, len(clock), *flat) + payload


def _events() -> list[tuple[int, bytes]]:
    k = KIND_BY_NAME
    return [
        (k["actor"].code, _body(0, 0, [], k["actor"].pack("main"))),
        (k["step_begin"].code, _body(0, 0, [(0, 1)], b"")),
        (k["batch"].code, _body(0, 0, [(0, 2)], k["batch"].pack([7, 3, 5]))),
        (k["loss"].code, _body(0, 0, [(0, 3)], k["loss"].pack(0.1))),
        (k["step_end"].code, _body(0, 0, [(0, 4)], b"")),
    ]


def build(chain: bool = False) -> tuple[bytes, list[int]]:
    out = bytearray(fmt.encode_segment_header(run_id=RUN_ID, salt=SALT, segment=0, first_seq=0, chain_prev=0,
                                              flags=fmt.FLAG_CHAIN if chain else 0, meta=META))
    offsets = []
    prev = 0
    for seq, (code, body) in enumerate(_events()):
        offsets.append(len(out))
        raw, prev = fmt.encode_record(seq, code, body, SALT, prev if chain else 0)
        out += raw
    return bytes(out), offsets


def vectors() -> dict[str, tuple[bytes, dict[str, Any]]]:
    basic, offs = build()
    chained, _ = build(chain=True)
    expected_events = [
        {"seq": 0, "actor": "main", "step": 0, "kind": "actor", "clock": {}, "payload": {"name": "main"}},
        {"seq": 1, "actor": "main", "step": 0, "kind": "step_begin", "clock": {"main": 1}, "payload": {}},
        {"seq": 2, "actor": "main", "step": 0, "kind": "batch", "clock": {"main": 2},
         "payload": {"sample_ids": [7, 3, 5]}},
        {"seq": 3, "actor": "main", "step": 0, "kind": "loss", "clock": {"main": 3}, "payload": {"value": 0.1}},
        {"seq": 4, "actor": "main", "step": 0, "kind": "step_end", "clock": {"main": 4}, "payload": {}},
    ]
    head = {"run_id": RUN_ID.hex(), "salt": SALT, "records_offset": offs[0], "record_offsets": offs}
    flipped = bytearray(basic)
    flipped[offs[2] + 45] ^= 0x04
    return {
        "basic": (basic, {**head, "chain": False, "events": expected_events, "dropped_bytes": 0}),
        "chain": (chained, {**head, "chain": True, "events": expected_events, "dropped_bytes": 0}),
        "torn": (basic + basic[offs[1] : offs[1] + 17],
                 {**head, "chain": False, "events": expected_events, "dropped_bytes": 17}),
        "corrupt-middle": (bytes(flipped), {**head, "chain": False,
                                            "error": {"type": "TapeCorruptError", "offset": offs[2], "seq": 2}}),
    }


def write_vectors() -> None:
    VECTORS.mkdir(parents=True, exist_ok=True)
    for name, (data, expect) in vectors().items():
        (VECTORS / f"{name}.tape").write_bytes(data)
        (VECTORS / f"{name}.json").write_text(json.dumps(expect, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("name", ["basic", "chain", "torn", "corrupt-middle"])
def test_vector_bytes_and_meaning(name: str) -> None:
    data, expect = vectors()[name]
    assert (VECTORS / f"{name}.tape").read_bytes() == data, "format drifted from the committed vector"
    assert json.loads((VECTORS / f"{name}.json").read_text()) == json.loads(json.dumps(expect))
    r = TapeReader(VECTORS / f"{name}.tape")
    assert r.run_id.hex() == expect["run_id"] and r.header.salt == expect["salt"]
    assert r.header.chain == expect["chain"] and r.header.size == expect["records_offset"]
    if "error" in expect:
        with pytest.raises(TapeCorruptError) as ei:
            list(r.events())
        assert (ei.value.offset, ei.value.seq) == (expect["error"]["offset"], expect["error"]["seq"])
        return
    got = [e.to_json() for e in r.events()]
    assert got == expect["events"]
    assert r.dropped_bytes == expect["dropped_bytes"]


def _section(title: str) -> str:
    text = SPEC.read_text()
    start = text.index(title)
    nxt = re.search(r"\n#{2,3} \d", text[start + len(title):])
    return text[start : start + len(title) + (nxt.start() if nxt else len(text))]


def test_spec_event_table_matches_code() -> None:
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| ([^|]*) \| (yes|no) \| ([^|]*) \|$", _section("### 6.2 Event kinds"),
                      re.M)
    assert len(rows) == len(KINDS)
    for (code, name, fields, decision, doc), k in zip(rows, KINDS):
        want_fields = ", ".join(f"{n}: {t}" for n, t in k.fields) or "-"
        assert (int(code), name, fields.strip(), decision == "yes", doc.strip()) == (
            k.code, k.name, want_fields, k.decision, k.doc)


def test_spec_field_types_and_limits_match_code() -> None:
    types = re.findall(r"^\| `(\w+)` \|", _section("### 6.1.1 Field types"), re.M)
    assert types == list(FIELD_TYPES)
    text = SPEC.read_text()
    assert f"{fmt.MAX_RECORD:,}".replace(",", " ") in text and fmt.MAX_RECORD == 16 << 20
    assert fmt.MAX_META == 1 << 20 and fmt.HEADER_FIXED == 64 and fmt.RECORD_HEADER == 40
    assert "`43 4B 50 54 54 41 50 45`" in text and fmt.MAGIC.hex(" ").upper() == "43 4B 50 54 54 41 50 45"


if __name__ == "__main__":  # pragma: no cover
    write_vectors()
    print(f"wrote {VECTORS}")
