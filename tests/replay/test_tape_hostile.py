"""Hostile and careless tapes (issue 9 items 5, 8, 14, 15): symlinks planted around a tape,
a tape cut at a record boundary or missing its last segment, a forged step index, and
payload maps a spec-following reader could read two ways."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import msgpack
import pytest
from click.testing import CliRunner

from ckpt_cli.main import cli
from replay import Recorder
from replay.errors import TapeCorruptError, TapeFormatError
from replay.events import KIND_BY_NAME
from replay.tape import TapeReader, TapeWriter
from replay.tape import format as fmt
from replay.tape.index import IndexEntry, encode_entry, encode_index_header, read_index

META = {"entry_point": None, "config_hash": "00"}


def _cli(*args: str):
    return CliRunner().invoke(cli, list(args))


def _record(path: Path, steps: int = 6, **opts) -> None:
    with Recorder.open(str(path), rng_every=0, **opts) as rec:
        for step in range(steps):
            with rec.step(step):
                rec.loss(step / 7)


# -- item 14: never follow a symlink ----------------------------------------------------------------
def test_writer_replaces_a_planted_index_link_instead_of_writing_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "outside" / "precious.txt"
    victim.parent.mkdir()
    victim.write_bytes(b"keep me")
    tapes = tmp_path / "tapes"
    tapes.mkdir()
    (tapes / "run.tape.idx").symlink_to(victim)
    _record(tapes / "run.tape")
    assert victim.read_bytes() == b"keep me"
    idx = tapes / "run.tape.idx"
    assert not idx.is_symlink() and read_index(idx, TapeReader(tapes / "run.tape").run_id)
    assert sorted(p.name for p in tapes.iterdir()) == ["run.tape", "run.tape.idx"]  # no temp file left


def test_writer_refuses_a_planted_tape_link_even_a_dangling_one(tmp_path: Path) -> None:
    victim = tmp_path / "precious.bin"
    victim.write_bytes(b"keep me")
    (tmp_path / "a.tape").symlink_to(victim)
    (tmp_path / "b.tape").symlink_to(tmp_path / "nowhere")
    for name in ("a.tape", "b.tape"):
        with pytest.raises(FileExistsError):
            TapeWriter(tmp_path / name, META)
    assert victim.read_bytes() == b"keep me" and not (tmp_path / "nowhere").exists()


def test_repair_refuses_a_symlinked_segment_and_replaces_a_linked_index(tmp_path: Path) -> None:
    tape = tmp_path / "run.tape"
    _record(tape, steps=40, segment_bytes=600)
    segs = sorted(tape.glob("*.seg"))
    assert len(segs) >= 3
    outside = tmp_path / "outside.seg"
    # The last segment without its close record, plus a torn tail, outside the tape.
    outside.write_bytes(segs[-1].read_bytes()[:-40] + b"\x01\x02\x03")
    before = outside.read_bytes()
    segs[-1].unlink()
    segs[-1].symlink_to(outside)
    r = _cli("tape", "repair", str(tape))
    assert r.exit_code == 3 and "symbolic link" in r.output
    assert outside.read_bytes() == before
    # A linked index is replaced by the rebuilt one, its target untouched.
    segs[-1].unlink()
    segs[-1].write_bytes(before)
    victim = tmp_path / "victim.idx"
    victim.write_bytes(b"keep me")
    (tape / "index").unlink()
    (tape / "index").symlink_to(victim)
    r = _cli("tape", "repair", str(tape))
    assert r.exit_code == 0 and "dropped 3 bytes" in r.output, r.output
    assert victim.read_bytes() == b"keep me" and not (tape / "index").is_symlink()
    assert not [p for p in tape.iterdir() if p.name.endswith(".tmp")]


# -- item 15: a truncated tape is visible ------------------------------------------------------------
def test_cut_at_a_record_boundary_is_not_closed(tmp_path: Path) -> None:
    tape = tmp_path / "run.tape"
    _record(tape)
    r = _cli("tape", "verify", str(tape))
    assert r.exit_code == 0 and "not closed" not in r.output
    data = tape.read_bytes()
    offsets = [f.offset for _, f in TapeReader(tape).frames()]
    cut = tmp_path / "cut.tape"
    cut.write_bytes(data[: offsets[-3]])  # at a record boundary: no torn bytes at all
    r = _cli("tape", "check", str(cut))
    assert r.exit_code == 0 and f"{cut} is not closed (ends at seq" in r.output
    assert "not closed" not in _cli("tape", "check", str(tape)).output
    r = _cli("tape", "verify", str(cut))
    rep = TapeReader(cut).verify()
    assert not rep.closed and rep.dropped_bytes == 0
    assert r.exit_code == 4 and f"not closed (ends at seq {rep.last_seq})" in r.output and "torn tail" not in r.output


def test_deleting_the_last_segment_is_not_closed(tmp_path: Path) -> None:
    tape = tmp_path / "run.tape"
    _record(tape, steps=40, segment_bytes=600)
    segs = sorted(tape.glob("*.seg"))
    assert len(segs) >= 3 and _cli("tape", "verify", str(tape)).exit_code == 0
    segs[-1].unlink()
    r = _cli("tape", "verify", str(tape))
    assert r.exit_code == 4 and "not closed (ends at seq" in r.output


def test_close_record_is_the_last_thing_in_a_tape(tmp_path: Path) -> None:
    tape = tmp_path / "run.tape"
    with TapeWriter(tape, META, chain=True) as w:
        w.append(100, b"x")
    data = tape.read_bytes()
    hdr = fmt.decode_segment_header(data)
    close = data[-40:]
    c, n, kind, flags, seq, salt, prev = struct.unpack("<QIHHQQQ", close)
    assert (n, kind, flags, seq, salt) == (0, fmt.CLOSE_KIND, 0, 1, hdr.salt) and prev != 0  # on the chain
    # A valid record appended after the close record is refused, not read.
    extra, _ = fmt.encode_record(2, 100, b"y", hdr.salt, c)
    (tmp_path / "x.tape").write_bytes(data + extra)
    with pytest.raises(TapeCorruptError, match="after the close record"):
        list(TapeReader(tmp_path / "x.tape").frames())


def _forge_index(tape: Path, entries: list[IndexEntry]) -> None:
    rid = TapeReader(tape).run_id
    (tape.with_name(tape.name + ".idx")).write_bytes(
        encode_index_header(rid) + b"".join(encode_entry(e, rid) for e in entries))


def test_forged_index_fails_verify_and_show_never_skips(tmp_path: Path) -> None:
    tape = tmp_path / "run.tape"
    _record(tape)
    r = TapeReader(tape)
    good = r.index()
    assert good and good == r._expected_index(decode_payloads=False)[0]
    assert good[0].seq == 1  # step 0 starts after the actor declaration, which §10 exclude
    # Step 1's entry, re-signed, now points at step 3's first record: a seek would skip steps 1-2.
    forged = [good[0], IndexEntry(1, good[3].seq, good[3].segment, good[3].offset), *good[4:]]
    _forge_index(tape, forged)
    r = _cli("tape", "verify", str(tape))
    assert r.exit_code == 3 and "step index" in r.output
    for from_step in ("1", "2"):
        r = _cli("tape", "show", str(tape), "--from-step", from_step)
        assert r.exit_code == 3 and "step index" in r.output and "is wrong" in r.output
    # A sparse but honest index only skips what it may: every step >= 2 is shown.
    _forge_index(tape, [good[0], good[4]])
    out = _cli("tape", "show", str(tape), "--from-step", "2", "--json", "--kind", "loss").output
    assert [int(ln.split('"step":')[1].split(",")[0]) for ln in out.splitlines()] == [2, 3, 4, 5]


# -- items 5 and 8: payload maps --------------------------------------------------------------------
@pytest.mark.parametrize("raw, what", [
    (b"\x81\x91\x01\x02", "list"),  # {[1]: 2}
    (b"\x81\x80\x02", "dict"),  # {{}: 2}
    (b"\x82\xa1a\x01\xa1a\x02", "repeats the key"),
    (b"\x82\xc3\xa1T\x01\xa1I", "bool"),  # {true: 'T', 1: 'I'}
    (b"\x81\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00\x01", "float"),  # {1.0: 1}
])
def test_bad_payload_map_keys_are_tape_errors_in_every_command(tmp_path: Path, raw: bytes, what: str) -> None:
    tape = tmp_path / "run.tape"
    with Recorder.open(str(tape), rng_every=0) as rec:
        rec.decide("order", "k", lambda: {"ok": 1})
    data = bytearray(tape.read_bytes())
    # Rewrite the decision's msgpack value and re-sign the record: the parser is tested, not the checksum.
    frames = [f for _, f in TapeReader(tape).frames()]
    fr = next(f for f in frames if f.kind == KIND_BY_NAME["decision"].code)
    body = bytes(fr.body)
    good = msgpack.packb({"ok": 1})
    assert body.endswith(struct.pack("<I", len(good)) + good)
    new_body = body[: -len(good) - 4] + struct.pack("<I", len(raw)) + raw
    hdr = fmt.decode_segment_header(bytes(data))
    rec_bytes, _ = fmt.encode_record(fr.seq, fr.kind, new_body, hdr.salt, 0)
    end = fr.offset + 40 + len(body)
    bad = tmp_path / "bad.tape"
    bad.write_bytes(bytes(data[: fr.offset]) + rec_bytes + bytes(data[end:]))
    with pytest.raises(TapeFormatError, match=what):
        TapeReader(bad).verify()
    for args in (["tape", "verify", str(bad)], ["tape", "show", str(bad)], ["tape", "show", "--json", str(bad)],
                 ["tape", "check", str(bad)]):
        r = _cli(*args)
        assert r.exit_code == 3 and "error:" in r.output and what in r.output, (args, r.output)
        assert not isinstance(r.exception, TypeError)


@pytest.mark.parametrize("value", [{1.5: 1}, {True: 1}, {None: 1}, {"a": {(1, 2): 3}}])
def test_encoder_refuses_a_map_no_reader_accepts(value: dict) -> None:
    with pytest.raises(ValueError, match="keys must be str or int"):
        KIND_BY_NAME["decision"].pack("order", "k", value)
    assert KIND_BY_NAME["decision"].pack("order", "k", {"a": {7: [1]}})  # str and int keys are fine


# -- issue 22 item 12: reader rules made explicit ---------------------------------------------------
def _resign(tape: Path, out: Path, kind: int, edit) -> None:
    """``out``: ``tape`` with the body of its first record of ``kind`` replaced by ``edit(body)``."""
    data = tape.read_bytes()
    fr = next(f for _, f in TapeReader(tape).frames() if f.kind == kind)
    hdr = fmt.decode_segment_header(data)
    rec, _ = fmt.encode_record(fr.seq, fr.kind, edit(bytes(fr.body)), hdr.salt, 0)
    out.write_bytes(data[: fr.offset] + rec + data[fr.offset + 40 + len(fr.body):])


def test_an_actor_declaration_with_a_clock_is_refused(tmp_path: Path) -> None:
    tape = tmp_path / "run.tape"
    _record(tape, steps=1)
    bad = tmp_path / "bad.tape"
    # the declaration's head (step, actor id, n=0) with n=1 and one (id 0, counter 1) entry
    _resign(tape, bad, KIND_BY_NAME["actor"].code,
            lambda b: b[:10] + struct.pack("<HHQ", 1, 0, 1) + b[12:])
    with pytest.raises(TapeFormatError, match="actor declaration carries a 1-entry clock"):
        TapeReader(bad).verify()


def test_a_zstd_block_on_a_tape_without_the_flag_is_refused(tmp_path: Path) -> None:
    tape = tmp_path / "run.tape"
    _record(tape, steps=30, zstd=True)
    data = tape.read_bytes()
    hdr = fmt.decode_segment_header(data)
    assert hdr.zstd and any(f.in_block for _, f in TapeReader(tape).frames())
    plain = fmt.encode_segment_header(run_id=hdr.run_id, salt=hdr.salt, segment=hdr.segment, first_seq=hdr.first_seq,
                                      chain_prev=hdr.chain_prev, flags=hdr.flags & ~fmt.FLAG_ZSTD, meta=hdr.meta)
    bad = tmp_path / "bad.tape"
    bad.write_bytes(plain + data[hdr.size:])
    with pytest.raises(TapeFormatError, match="zstd block on a tape without the ZSTD flag"):
        TapeReader(bad).verify()
