"""Tape half of the fuzz run (see bench/fuzz.py): mutate real tapes, re-sign, read.

Bases are the tape vectors (``spec/vectors/tape/*.tape``, written by the real
recorder). Byte mutations (bit flips, truncations, extensions) are not re-signed: a
reader must refuse them or return the original events (a prefix of them for a cut
tail, which tape §7 allows). Record mutations are re-signed by writing every record
again through ``TapeWriter`` (checksums, salts and chain recomputed): one record's body
gets flipped bits or a hostile msgpack payload spliced in, so the event decoders are
what must refuse it. A re-signed tape that reads must decode to events whose fields a
plain msgpack decode agrees with.

Reading is ``TapeReader(path).verify()`` plus decoding every event. Only the tape
modules are read here; their fixes belong to the tape owners.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import msgpack

REPO = Path(__file__).resolve().parents[1]
# the clean tape vectors: the damaged ones (corrupt-middle, torn) are not bases
BASES = [p for p in sorted((REPO / "spec" / "vectors" / "tape").glob("*.tape")) if p.stem in ("basic", "chain")]

__all__ = ["run", "MUTATORS", "tape_case"]


def _events(path: Path) -> list[Any]:
    """What ``tape verify``, ``tape check`` and ``tape show`` read: every record, every event,
    the invariants, each payload as shown."""
    from replay.check import check_tape
    from replay.tape.reader import TapeReader

    from replay.events import jsonable

    r = TapeReader(path)
    r.verify()
    check_tape(path)
    out = []
    for e in TapeReader(path).events():
        jsonable(e.payload)  # what `tape show` prints
        out.append((e.seq, e.kind, e.actor, e.step, repr(e.payload), repr(e.clock)))
    return out


def _rewrite(src: Path, dst: Path, edit: Callable[[int, int, bytes], bytes]) -> None:
    """Copy every record of ``src`` into a new tape at ``dst`` through the real writer,
    so every checksum is right; ``edit(index, kind, body)`` may change a body."""
    from replay.tape.reader import TapeReader
    from replay.tape.writer import TapeWriter

    r = TapeReader(src)
    h = r.header
    meta = dict(h.meta)
    actors = meta.pop("actors", [])
    w = TapeWriter(dst, meta, run_id=h.run_id, chain=bool(h.flags & 1), index=False)
    w.actors = list(actors)
    for i, (_, fr) in enumerate(r.frames()):
        w.append(fr.kind, edit(i, fr.kind, bytes(fr.body)))
    w.close()


def _flip(p: Path, d: Any) -> bool:
    b = bytearray(p.read_bytes())
    b[d.integer(0, len(b) - 1)] ^= 1 << d.integer(0, 7)
    p.write_bytes(bytes(b))
    return False


def _truncate(p: Path, d: Any) -> bool:
    b = p.read_bytes()
    p.write_bytes(b[: d.integer(0, len(b) - 1)])
    return False


def _extend(p: Path, d: Any) -> bool:
    with open(p, "ab") as f:
        f.write(d.raw(1, 64))
    return False


def _body_flip(p: Path, d: Any) -> bool:
    tmp = p.with_suffix(".new")
    n = len(_frames(p))
    target = d.integer(0, n - 1)

    def edit(i: int, kind: int, body: bytes) -> bytes:
        if i != target or not body:
            return body
        b = bytearray(body)
        for _ in range(d.integer(1, 3)):
            b[d.integer(0, len(b) - 1)] ^= 1 << d.integer(0, 7)
        return bytes(b)

    _rewrite(p, tmp, edit)
    p.unlink()
    tmp.rename(p)
    return True


def _body_msgpack(p: Path, d: Any) -> bool:
    """Replace a msgpack field inside a record body (u32 length + msgpack) by a hostile one."""
    tmp = p.with_suffix(".new")
    hostile = [
        b"\x81\x91\x01\xa1x",  # {[1]: 'x'}: a list as a map key
        b"\x81\x81\x01\x02\xa1x",  # {{1: 2}: 'x'}: a map as a map key
        b"\x82\xc3\xa1T\x01\xa1I",  # {true: 'T', 1: 'I'}
        b"\x82\xa1k\x01\xa1k\x02",  # {'k': 1, 'k': 2}
        b"\xd6\xff\x00\x00\x00\x01",  # timestamp
        b"\xc7\x01\x05x",  # ext 5
        b"\x91" * 5000 + b"\xc0",  # deep
        b"\xdd\xff\xff\xff\xff",  # array32 claiming 2^32-1
        msgpack.packb(d.value(), use_bin_type=True),
    ]
    payload = d.choice(hostile)
    frames = _frames(p)
    spots = [i for i, (_, body) in enumerate(frames) if _msgpack_field(body) is not None]
    if not spots:
        return _body_flip(p, d)
    target = d.choice(spots)

    def edit(i: int, kind: int, body: bytes) -> bytes:
        if i != target:
            return body
        at = _msgpack_field(body)
        assert at is not None
        start, end = at
        return body[: start - 4] + struct.pack("<I", len(payload)) + payload + body[end:]

    _rewrite(p, tmp, edit)
    p.unlink()
    tmp.rename(p)
    return True


def _frames(p: Path) -> list[tuple[int, bytes]]:
    from replay.tape.reader import TapeReader

    return [(fr.kind, bytes(fr.body)) for _, fr in TapeReader(p).frames()]


def _msgpack_field(body: bytes) -> tuple[int, int] | None:
    """Where the last length-prefixed msgpack document of a body sits, if it ends the body."""
    for start in range(len(body) - 1, 3, -1):
        (n,) = struct.unpack_from("<I", body, start - 4)
        if start + n == len(body) and n > 0:
            try:
                msgpack.unpackb(body[start:], raw=False, strict_map_key=False)
            except Exception:
                continue
            return start, len(body)
    return None


MUTATORS: dict[str, Callable[[Path, Any], bool]] = {
    "tape-flip": _flip,
    "tape-truncate": _truncate,
    "tape-extend": _extend,
    "tape-body-flip": _body_flip,
    "tape-body-msgpack": _body_msgpack,
}


def tape_case(kit: Any, root: Path, n: int, name: str, d: Any, *, timeout: float) -> Any:
    """``kit``: the bench/fuzz.py module (Outcome, time_limit, the documented-error test)."""
    import traceback

    Outcome, Hang = kit.Outcome, kit._Hang
    base = d.choice(BASES)
    work = root / f"tape-{n}"
    work.mkdir(parents=True)
    p = work / base.name
    shutil.copy(base, p)
    original = _events(base)
    try:
        with kit.time_limit(timeout):
            try:
                resigned = MUTATORS[name](p, d)
                got = _events(p)
            except Hang:
                raise
            except BaseException as e:
                if kit._documented(e):
                    return Outcome("refused", name, f"{type(e).__name__}: {str(e)[:160]}")
                return Outcome("other", name, "".join(traceback.format_exception(e))[-1500:])
            if not resigned:
                if got != original[: len(got)]:
                    return Outcome("wrong", name, "events differ from the original without re-signing")
            return Outcome("exact", name)
    except Hang:
        return Outcome("hang", name, f"over {timeout}s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(kit: Any, root: Path, cases: int, rng: Any, *, timeout: float) -> tuple[dict[str, int], list[Any]]:
    counts: dict[str, int] = {}
    bad = []
    names = sorted(MUTATORS)
    for i in range(cases):
        out = tape_case(kit, root, i, names[i % len(names)], kit.RandomDraw(rng), timeout=timeout)
        counts[out.kind] = counts.get(out.kind, 0) + 1
        if out.kind in ("wrong", "other", "hang"):
            bad.append(out)
    return counts, bad
