"""spec/tape-format.md agrees with the code, and the test vectors decode as documented.

Run this file as a script to regenerate spec/vectors/tape/ (the test then checks the
bytes are reproduced exactly, so a format change cannot slip in unnoticed).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ckpt.context.config import config_hash  # noqa: E402
from replay.errors import TapeCorruptError, TapeFormatError, TapeTruncatedError  # noqa: E402
from replay.events import FIELD_TYPES, KIND_BY_NAME, KINDS  # noqa: E402
from replay.tape.index import IndexEntry, encode_entry, encode_index_header  # noqa: E402
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


def _decision(value_msgpack: bytes) -> bytes:
    """A decision payload whose msgpack value is given as raw bytes (to craft bad maps)."""
    k = KIND_BY_NAME["decision"]
    return k.pack("order", "k", 0)[:-5] + struct.pack("<I", len(value_msgpack)) + value_msgpack


def build(chain: bool = False, *, close: bool = True, first_seq: int = 0,
          events: list[tuple[int, bytes]] | None = None) -> tuple[bytes, list[int]]:
    out = bytearray(fmt.encode_segment_header(run_id=RUN_ID, salt=SALT, segment=0, first_seq=first_seq, chain_prev=0,
                                              flags=fmt.FLAG_CHAIN if chain else 0, meta=META))
    offsets = []
    prev = 0
    seq = first_seq
    for seq, (code, body) in enumerate(events if events is not None else _events(), start=first_seq):
        offsets.append(len(out))
        raw, prev = fmt.encode_record(seq, code, body, SALT, prev if chain else 0)
        out += raw
    if close:
        offsets.append(len(out))
        out += fmt.encode_record(seq + 1, fmt.CLOSE_KIND, b"", SALT, prev if chain else 0)[0]
    return bytes(out), offsets


def _index(entries: list[tuple[int, int, int]]) -> bytes:
    return encode_index_header(RUN_ID) + b"".join(encode_entry(IndexEntry(st, sq, 0, off), RUN_ID)
                                                  for st, sq, off in entries)


def _two_steps() -> tuple[bytes, list[int], list[tuple[int, bytes]]]:
    evs = _events()
    k = KIND_BY_NAME
    evs += [(k["step_begin"].code, _body(1, 0, [(0, 5)], b"")), (k["step_end"].code, _body(1, 0, [(0, 6)], b""))]
    data, offs = build(events=evs)
    return data, offs, evs


# Configs and their §4 config_hash (a reader recomputes it from these bytes of rule).
CONFIG_HASH_CASES: list[dict[str, Any]] = [
    {"config": {}},
    {"config": {"lr": 0.5, "steps": 10, "name": "run"}},
    {"config": {"b": {"y": [1, 2.5, None, True], "x": "é"}, "a": -3, "Z": 2**40, "10": 1, "9": 2}},
]


def vectors() -> dict[str, tuple[bytes, dict[str, Any]]]:
    basic, offs = build()
    open_, _ = build(close=False)
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
    ok = {"chain": False, "events": expected_events, "dropped_bytes": 0}
    out: dict[str, tuple[bytes, dict[str, Any]]] = {
        "basic": (basic, {**head, **ok, "closed": True}),
        "chain": (chained, {**head, **ok, "chain": True, "closed": True}),
        "unclosed": (open_, {**head, **ok, "record_offsets": offs[:-1], "closed": False}),
        "torn": (open_ + basic[offs[1] : offs[1] + 17],
                 {**head, **ok, "record_offsets": offs[:-1], "dropped_bytes": 17, "closed": False}),
        "corrupt-middle": (bytes(flipped), {**head, "chain": False,
                                            "error": {"type": "TapeCorruptError", "offset": offs[2], "seq": 2}}),
        # §5.5: nothing may follow the close record, not even bytes that look torn.
        "after-close": (basic + b"\x00" * 5, {**head, "chain": False,
                                               "error": {"type": "TapeCorruptError", "offset": len(basic), "seq": 6}}),
        # §7 rule 2: a first segment's header cut short is not a torn tail; the tape holds nothing.
        "header-cut": (basic[:50], {"error": {"type": "TapeTruncatedError", "offset": 0}}),
        # §3: a tape's first segment starts at seq 0.
        "first-seq": (build(first_seq=3)[0], {"error": {"type": "TapeCorruptError", "offset": 48}}),
    }
    # §6.1.1 map keys: duplicates, booleans and containers as keys are refused.
    for name, raw in (("dup-key", b"\x82\xa1a\x01\xa1a\x02"), ("bool-key", b"\x82\xc3\xa1T\x01\xa1I"),
                      ("list-key", b"\x81\x91\x01\x02")):
        evs = _events()[:1] + [(KIND_BY_NAME["decision"].code, _body(0, 0, [(0, 1)], _decision(raw)))]
        data, o = build(events=evs)
        out[name] = (data, {"error": {"type": "TapeFormatError", "offset": o[1], "seq": 1}})
    # §10: an index entry must agree with the records (the first entry is the first
    # non-actor record of step 0: seq 1, not seq 0).
    two, o2, _ = _two_steps()
    out["index"] = (two, {"index": _index([(0, 1, o2[1]), (1, 5, o2[5])]).hex(), "closed": True,
                          "index_status": "ok"})
    out["forged-index"] = (two, {"index": _index([(0, 1, o2[1]), (1, 3, o2[3])]).hex(),
                                 "error": {"type": "TapeCorruptError", "offset": 64}})
    return out


def write_vectors() -> None:
    VECTORS.mkdir(parents=True, exist_ok=True)
    for name, (data, expect) in vectors().items():
        (VECTORS / f"{name}.tape").write_bytes(data)
        (VECTORS / f"{name}.json").write_text(json.dumps(expect, indent=2, sort_keys=True) + "\n")
    cases = [{**c, "config_hash": config_hash(c["config"])} for c in CONFIG_HASH_CASES]
    (VECTORS / "config-hash.json").write_text(json.dumps(cases, indent=2, ensure_ascii=False) + "\n")


ERRORS = {"TapeCorruptError": TapeCorruptError, "TapeFormatError": TapeFormatError,
          "TapeTruncatedError": TapeTruncatedError}


@pytest.mark.parametrize("name", list(vectors()))
def test_vector_bytes_and_meaning(name: str, tmp_path: Path) -> None:
    data, expect = vectors()[name]
    assert (VECTORS / f"{name}.tape").read_bytes() == data, "format drifted from the committed vector"
    assert json.loads((VECTORS / f"{name}.json").read_text()) == json.loads(json.dumps(expect))
    path = tmp_path / f"{name}.tape"  # a copy, so the index sidecar can sit beside it
    path.write_bytes(data)
    if "index" in expect:
        (tmp_path / f"{name}.tape.idx").write_bytes(bytes.fromhex(expect["index"]))
    if "error" in expect:
        err = expect["error"]
        with pytest.raises(ERRORS[err["type"]]) as ei:
            TapeReader(path, torn_ok=True).verify()
        assert type(ei.value) is ERRORS[err["type"]] and ei.value.offset == err["offset"]
        if "seq" in err:
            assert ei.value.seq == err["seq"]
        return
    r = TapeReader(path)
    rep = r.verify()
    assert rep.closed == expect["closed"]
    if "index_status" in expect:
        assert rep.index == expect["index_status"]
        return
    assert r.run_id.hex() == expect["run_id"] and r.header.salt == expect["salt"]
    assert r.header.chain == expect["chain"] and r.header.size == expect["records_offset"]
    got = [e.to_json() for e in r.events()]
    assert got == expect["events"]
    assert r.dropped_bytes == expect["dropped_bytes"]


def test_config_hash_vectors() -> None:
    cases = json.loads((VECTORS / "config-hash.json").read_text(encoding="utf-8"))
    assert [c["config"] for c in cases] == [c["config"] for c in CONFIG_HASH_CASES]
    for c in cases:
        assert config_hash(c["config"]) == c["config_hash"]
    # One reading (§4 -> checkpoint-format.md §8.2), spelled out here by hand.
    assert config_hash({"b": 1, "a": 2.5}) == "sha256:" + hashlib.sha256(msgpack.packb({"a": 2.5, "b": 1})).hexdigest()


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
