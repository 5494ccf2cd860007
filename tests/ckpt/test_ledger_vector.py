"""spec/vectors/tape/ledger.tape: a step ledger tape (kinds 22-24) with fixed run id and salt.

Both readers must decode it as the .json says: replay's generic event reader and
``ckpt.ledger.read_ledger_tape``. Run this file as a script to regenerate the vector.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ckpt.ledger import LedgerOpen, LedgerStep, ResumeCheck, read_ledger_tape  # noqa: E402
from ckpt.ledger.record import encode_event  # noqa: E402
from ckpt.tape import format as fmt  # noqa: E402

VEC = ROOT / "spec" / "vectors" / "tape"
RUN_ID = bytes.fromhex("00112233445566778899aabbccddeeff")
SALT = 0x0123456789ABCDEF
META = {"ledger": 1, "run_id": "0123456789abcdef", "actors": []}
D1, D2, D3 = bytes(range(16)), bytes(range(16, 32)), bytes(range(32, 48))
RECORDS = [
    "ledger",
    LedgerOpen("0123456789abcdef", 4, "step-00000004", (("python", D1), ("torch_cpu", D2))),
    LedgerStep(5, (("python", D1), ("torch_cpu", D3)), D2, struct.unpack("<d", bytes.fromhex("000000e0cdcc0c40"))[0], None),
    LedgerStep(6, (("python", D1), ("torch_cpu", D1)), None, None, D3),
    ResumeCheck("exact", 5, 6, "resume verified exact over steps 5..6; unused, not compared: rng python"),
]


def build() -> bytes:
    out = bytearray(fmt.encode_segment_header(run_id=RUN_ID, salt=SALT, segment=0, first_seq=0, chain_prev=0,
                                              flags=0, meta=META))
    counter = 0
    for seq, rec in enumerate(RECORDS):
        if not isinstance(rec, str):
            counter += 1
        code, body = encode_event(rec, counter, step=6)
        out += fmt.encode_record(seq, code, body, SALT)[0]
    return bytes(out)


def expected() -> list[dict]:
    from replay.tape import TapeReader

    return [e.to_json() for e in TapeReader(VEC / "ledger.tape").events()]


def write() -> None:
    (VEC / "ledger.tape").write_bytes(build())
    (VEC / "ledger.json").write_text(json.dumps({"events": expected()}, indent=2, sort_keys=True) + "\n")


def test_ledger_vector_bytes_and_both_readers() -> None:
    assert (VEC / "ledger.tape").read_bytes() == build(), "ledger encoding drifted from the committed vector"
    want = json.loads((VEC / "ledger.json").read_text())["events"]
    assert [e["kind"] for e in want] == ["actor", "ledger_open", "ledger_step", "ledger_step", "resume_check"]
    assert json.loads(json.dumps(expected())) == want
    t = read_ledger_tape(str(VEC / "ledger.tape"))
    assert t.run_id == "0123456789abcdef" and t.torn == 0
    assert t.opens == [RECORDS[1]] and t.steps == RECORDS[2:4] and t.checks == [RECORDS[4]]
    assert struct.pack("<d", t.steps[0].loss) == bytes.fromhex("000000e0cdcc0c40")  # loss bits, exact


if __name__ == "__main__":
    write()
