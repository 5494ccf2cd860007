"""Fuzz the checkpoint and tape readers with mutated real files, re-signing the digests.

    python bench/fuzz.py [--cases N] [--seed S] [--case-timeout SECONDS]

Each case copies a small real checkpoint (or tape), applies one mutation and, for most
mutations, **re-signs** what the mutation broke: chunk digests, sizes, the content id
and the MANIFEST digest (for tapes: every record checksum, by writing the mutated events
through the tape writer). So the case reaches the parsers instead of stopping at the
first checksum. Then it opens, verifies and fully loads the result and classifies it:

- ``exact``: loaded, and every tensor and value equals what an independent decoder reads
  from the same files (stock ``safetensors`` for tensor bytes, plain ``msgpack`` with
  its own extension handling for the state tree) — and, when the mutation was not
  re-signed, equals the original checkpoint bit for bit;
- ``refused``: raised a documented error (``ckpt.errors.CkptError`` or
  ``replay.errors.TapeError``/``ReplayError``);
- ``wrong``: loaded, but something differs (silent wrong data; must be 0);
- ``other``: any other exception escaped (must be 0);
- ``hang``: the case ran past its time limit (must be 0).

The same mutators run from ``tests/ckpt/test_fuzz.py`` under hypothesis (a bounded run
inside the suite); this script is the long run (``make fuzz``) and prints the counts
and the peak RSS of the process.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import msgpack  # noqa: E402
import xxhash  # noqa: E402
import zstandard  # noqa: E402

__all__ = ["Draw", "RandomDraw", "Fuzzer", "Outcome", "MUTATORS", "main"]

CHUNK = 4096
MANIFEST = "MANIFEST"
STATE = "rank-00000.state.msgpack.zst"
TENSORS = "rank-00000.safetensors"


class Draw(Protocol):
    """Where a mutator's choices come from: ``random.Random`` here, hypothesis in tests."""

    def integer(self, lo: int, hi: int) -> int: ...
    def choice(self, seq: list[Any]) -> Any: ...
    def raw(self, lo: int, hi: int) -> bytes: ...
    def value(self) -> Any: ...


class RandomDraw:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, seq: list[Any]) -> Any:
        return seq[self.rng.randrange(len(seq))]

    def raw(self, lo: int, hi: int) -> bytes:
        return bytes(self.rng.getrandbits(8) for _ in range(self.rng.randint(lo, hi)))

    def value(self, depth: int = 0) -> Any:
        """A msgpack-able value, hostile ones included (see ``hostile_values``)."""
        r = self.rng
        k = r.randrange(14 if depth < 4 else 9)
        if k == 0:
            return None
        if k == 1:
            return r.choice([True, False])
        if k == 2:
            return r.choice([0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, r.getrandbits(64) - 2**63])
        if k == 3:
            return r.choice([0.0, -0.0, 1.0, math.inf, math.nan, r.random()])
        if k == 4:
            return r.choice(["", "a", "step-1\n", "@data", "٣٣", "x" * r.randint(0, 64)])
        if k == 5:
            return self.raw(0, 16)
        if k in (6, 7, 8):
            return self.choice(hostile_values())
        if k in (9, 10):
            return [self.value(depth + 1) for _ in range(r.randint(0, 4))]
        out: dict[Any, Any] = {}
        for i in range(r.randint(0, 4)):
            key = self.value(depth + 1) if r.random() < 0.3 else f"k{i}"
            with contextlib.suppress(TypeError):  # an unhashable drawn key
                out[key] = self.value(depth + 1)
        return out


@functools.lru_cache(maxsize=1)
def hostile_values() -> list[Any]:
    """Values a writer never makes: every extension code with bad and good payloads,
    BIGINT in non-canonical forms, bad devices and dtypes, deep nesting."""
    E = msgpack.ExtType
    tuple_bomb = msgpack.packb([None])
    for _ in range(300):
        tuple_bomb = msgpack.packb([E(2, tuple_bomb)])
    return [
        E(0, b""), E(7, b"x"), E(127, b"x"), msgpack.Timestamp(1, 0), msgpack.Timestamp(2**40, 999),
        E(1, b"model/nope"), E(1, b"\xff\xfe"), E(1, b""),
        E(2, b"\xc1"), E(2, msgpack.packb({"a": 1})), E(2, msgpack.packb([1, E(5, b"rank-00000")])), E(2, tuple_bomb),
        E(3, b"float32"), E(3, b"torch.float32"), E(3, b"complex256"),
        E(4, b"18446744073709551616"), E(4, b"5"), E(4, b"007"), E(4, b"-0"), E(4, "٣٣".encode()), E(4, b"+5"),
        E(4, b"1" * 5000), E(4, b""), E(4, b"12a"),
        E(5, b"rank-00000"), E(5, b"rank-00009"), E(5, b"../x"),
        E(6, b"cpu"), E(6, b"cuda:0"), E(6, b"cuda:-1"), E(6, b"gpu"), E(6, b"cpu:007"), E(6, b"cuda:99999999999"), E(6, b""),
        [[[[[[[[[[[[[[[[None]]]]]]]]]]]]]]]],
    ]


# --- re-signing ------------------------------------------------------------------------------------------


def chunk_digests(data: bytes, chunk_size: int) -> bytes:
    return b"".join(xxhash.xxh3_128_digest(data[i : i + chunk_size]) for i in range(0, len(data), chunk_size))


def read_body(ck: Path) -> Any:
    data = (ck / MANIFEST).read_bytes()
    (n,) = struct.unpack_from("<Q", data, 16)
    return msgpack.unpackb(data[24 : 24 + n], raw=False, strict_map_key=False)


def write_manifest(ck: Path, body: Any, *, head: bytes | None = None, fix_id: bool = True) -> None:
    """Encode ``body`` (possibly hostile) as MANIFEST, with a matching id and digest."""
    if fix_id:
        with contextlib.suppress(Exception):  # a hostile body may have no parts to hash
            ids = [[p["name"], [[f[0], f[2], f[4]] for f in p["files"]]] for p in body["parts"]]
            body["id"] = xxhash.xxh3_128_digest(msgpack.packb(ids, use_bin_type=True)).hex()
    b = msgpack.packb(body, use_bin_type=True)
    h = head[:16] + struct.pack("<Q", len(b)) if head is not None else struct.pack("<8sHHIQ", b"CKPTMNFT", 1, 0, 0, len(b))
    (ck / MANIFEST).write_bytes(h + b + xxhash.xxh3_128_digest(h + b))


def resign(ck: Path, changed: dict[str, bytes], *, raw_size: dict[str, int] | None = None) -> None:
    """Write ``changed`` files and make the MANIFEST describe them exactly."""
    for name, data in changed.items():
        (ck / name).write_bytes(data)
    body = read_body(ck)
    for p in body["parts"]:
        for f in p["files"]:
            if f[0] in changed:
                data = changed[f[0]]
                f[2] = len(data)
                f[4] = chunk_digests(data, f[3])
                if raw_size and f[0] in raw_size:
                    f[6] = raw_size[f[0]]
    write_manifest(ck, body)


def state_doc(ck: Path) -> bytes:
    return zstandard.ZstdDecompressor().decompress((ck / STATE).read_bytes())


def put_state_doc(ck: Path, doc: bytes) -> None:
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(doc)
    resign(ck, {STATE: frame}, raw_size={STATE: len(doc)})


# --- mutators --------------------------------------------------------------------------------------------
# Each takes (checkpoint dir, other checkpoint dir, draw) and returns True when it
# re-signed (the result may legitimately load with new content).


def _files(ck: Path) -> list[str]:
    return sorted(p.name for p in ck.iterdir())


def m_flip(ck: Path, other: Path, d: Draw) -> bool:
    name = d.choice(_files(ck))
    b = bytearray((ck / name).read_bytes())
    if b:
        b[d.integer(0, len(b) - 1)] ^= 1 << d.integer(0, 7)
    (ck / name).write_bytes(bytes(b))
    return False


def m_truncate(ck: Path, other: Path, d: Draw) -> bool:
    name = d.choice(_files(ck))
    b = (ck / name).read_bytes()
    (ck / name).write_bytes(b[: d.integer(0, max(0, len(b) - 1))])
    return False


def m_extend(ck: Path, other: Path, d: Draw) -> bool:
    name = d.choice(_files(ck))
    with open(ck / name, "ab") as f:
        f.write(d.raw(1, 64))
    return False


def m_swap_files(ck: Path, other: Path, d: Draw) -> bool:
    a, b = STATE, TENSORS
    da, db = (ck / a).read_bytes(), (ck / b).read_bytes()
    if d.choice([True, False]):
        resign(ck, {a: db, b: da})  # wrong roles, digests right: the parsers must refuse
        return True
    (ck / a).write_bytes(db)
    (ck / b).write_bytes(da)
    return False


def m_swap_from_other(ck: Path, other: Path, d: Draw) -> bool:
    """Take one file (or the MANIFEST) from another checkpoint of the same layout."""
    name = d.choice(_files(ck))
    data = (other / name).read_bytes()
    if name != MANIFEST and d.choice([True, False]):
        body = read_body(other) if name == STATE else None
        raw = None
        if body is not None:
            raw = {STATE: next(f[6] for f in body["parts"][0]["files"] if f[0] == STATE)}
        resign(ck, {name: data}, raw_size=raw)
        return True
    (ck / name).write_bytes(data)
    return False


def m_flip_resigned(ck: Path, other: Path, d: Draw) -> bool:
    """Flip bits in a data file's structure and re-sign: only the parsers stand guard."""
    name = d.choice([STATE, TENSORS])
    b = bytearray((ck / name).read_bytes())
    if name == STATE:
        doc = bytearray(state_doc(ck))
        for _ in range(d.integer(1, 3)):
            doc[d.integer(0, len(doc) - 1)] ^= 1 << d.integer(0, 7)
        put_state_doc(ck, bytes(doc))
        return True
    (n,) = struct.unpack_from("<Q", b, 0)
    for _ in range(d.integer(1, 3)):
        b[d.integer(0, min(len(b), 8 + n + 64) - 1)] ^= 1 << d.integer(0, 7)  # prefix, header, first data
    resign(ck, {name: bytes(b)})
    return True


def m_manifest_field(ck: Path, other: Path, d: Draw) -> bool:
    """Set one MANIFEST field (top level, part, file or tensor entry) to a drawn value."""
    body = read_body(ck)
    spots: list[tuple[Any, Any]] = [(body, k) for k in list(body)] + [(body, "extra_key")]
    for p in body["parts"]:
        spots += [(p, k) for k in list(p)]
        for f in p["files"]:
            spots += [(f, i) for i in range(len(f))]
        for t in p["tensors"]:
            spots += [(t, i) for i in range(len(t))]
            spots += [(t[2], i) for i in range(len(t[2]))]
    holder, key = d.choice(spots)
    holder[key] = d.choice([d.value(), d.value(), 2**62, 2**64 - 1, 1 << 30, -1, 64.0, True, "step-1\n"])
    write_manifest(ck, body, fix_id=d.choice([True, True, False]))
    return True


def m_huge_sizes(ck: Path, other: Path, d: Draw) -> bool:
    """Declared sizes far beyond the bytes: chunk size, raw size, shapes, header length."""
    body = read_body(ck)
    p = body["parts"][0]
    sf = next(f for f in p["files"] if f[1] == "state")
    tf = next(f for f in p["files"] if f[1] == "tensors")
    what = d.integer(0, 6)
    if what == 0:  # 1 GiB chunks: one digest covers the small file
        for f in (sf, tf):
            f[3] = 1 << 30
            f[4] = chunk_digests((ck / f[0]).read_bytes(), 1 << 30)
    elif what == 1:  # raw_size at the limit with a frame that agrees
        doc = state_doc(ck)
        doc = doc + b"\x00" * d.choice([1 << 20, 1 << 26])
        put_state_doc(ck, doc)
        return True
    elif what == 2:  # a zero-dim tensor whose other dims overflow
        t = p["tensors"][0]
        t[2] = [0, 2**62, 2**62]
        t[5] = 0
    elif what == 3:  # a shape claiming more elements than the file holds
        t = p["tensors"][0]
        t[2] = [2**40]
        t[5] = 2**40 * 4
    elif what == 4:  # safetensors prefix claiming more than the file
        b = bytearray((ck / TENSORS).read_bytes())
        b[:8] = struct.pack("<Q", d.choice([1 << 26, 1 << 40, len(b)]))
        resign(ck, {TENSORS: bytes(b)})
        return True
    elif what == 5:  # zstd frame lying about its content size
        frame = struct.pack("<IBQ", 0xFD2FB528, 0b1110_0000, 1 << 29) + b"\x01\x00\x00"
        resign(ck, {STATE: frame}, raw_size={STATE: 1 << 29})
        return True
    else:  # a file size beyond the file
        tf[2] = 1 << 40
        tf[3] = 1 << 30
        tf[4] = chunk_digests((ck / tf[0]).read_bytes(), 1 << 30) * 1024  # a digest list that fits the size
    write_manifest(ck, body)
    return True


def hostile_headers(header: dict[str, Any], data_len: int) -> list[bytes]:
    """Safetensors headers a writer never makes. Cases follow the tests of the stock
    library (huggingface/safetensors, safetensors/src/tensor.rs: test_header_too_large,
    test_header_too_small, test_invalid_header_length, test_invalid_header_non_utf8,
    test_invalid_header_not_json, test_whitespace_padded_header, test_zero_sized_tensor,
    and the TensorInvalidInfo / InvalidOffset / MetadataIncompleteBuffer cases), plus
    the ones our spec adds (§6.1)."""
    key = next(k for k in header if k != "__metadata__")
    h = header[key]
    out: list[Any] = [
        b"{", b"\xff", b"", b"[]", b"null", b'"x"', b"{}",
        {**header, key: {**h, "shape": [float(x) for x in h["shape"]]}},
        {**header, key: {**h, "shape": [True] * len(h["shape"])}},
        {**header, key: {**h, "data_offsets": [float(x) for x in h["data_offsets"]]}},
        {**header, key: {**h, "data_offsets": [h["data_offsets"][1], h["data_offsets"][0]]}},
        {**header, key: {**h, "data_offsets": [0, data_len + 8]}},
        {**header, key: {**h, "data_offsets": [-8, h["data_offsets"][1]]}},
        {**header, key: {**h, "shape": [0, 2**62, 2**62]}},
        {**header, key: {**h, "shape": [2**64]}},
        {**header, key: {**h, "shape": [10**40]}},
        {**header, key: {**h, "dtype": "F128"}},
        {**header, key: {**h, "extra": 1}},
        {**header, key: {k: v for k, v in h.items() if k != "dtype"}},
        {**header, "__metadata__": {"format": 5}},
        {**header, "__metadata__": "pt"},
        {**header, "__metadata__": {"nested": {"a": "b"}}},
        {**header, "another": h},
    ]
    enc: list[bytes] = []
    for x in out:
        b = x if isinstance(x, bytes) else json.dumps(x, separators=(",", ":")).encode()
        enc.append(b + b" " * (-len(b) % 8))
    body = json.dumps(header, separators=(",", ":")).encode()
    enc += [
        body + b"\r\n\t " * 2,  # stock safetensors accepts any JSON whitespace; we want spaces
        body,  # unpadded: breaks the alignment rule unless it happens to fit
        b" " * 8 + body + b" " * (-len(body) % 8),
        body[:-1] + b',"' + key.encode() + b'":' + json.dumps(h).encode() + b"}",  # duplicate key
        b"[" * 100_000 + b"]" * 100_000,  # recursion
        b'{"a":' + b"9" * 5000 + b"}",  # int digit limit
        body.replace(b"}", b"}" + b"\x00" * 3, 1),
    ]
    return enc


def m_hostile_header(ck: Path, other: Path, d: Draw) -> bool:
    b = (ck / TENSORS).read_bytes()
    (n,) = struct.unpack_from("<Q", b, 0)
    header = json.loads(b[8 : 8 + n])
    data = b[8 + n :]
    new = d.choice(hostile_headers(header, len(data)))
    resign(ck, {TENSORS: struct.pack("<Q", len(new)) + new + data})
    return True


def m_hostile_tree(ck: Path, other: Path, d: Draw) -> bool:
    """Put a hostile value somewhere in the state document (or the context), re-signed."""
    doc = msgpack.unpackb(state_doc(ck), raw=False, strict_map_key=False)
    holders: list[tuple[Any, Any]] = []
    stack = [doc]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            holders += [(v, k) for k in v]
            stack.extend(v.values())
        elif isinstance(v, list):
            holders += [(v, i) for i in range(len(v))]
            stack.extend(v)
    holder, key = d.choice(holders)
    how = d.integer(0, 3)
    if how == 0 and isinstance(holder, dict):  # a hostile key
        new = d.value()
        try:
            hash(new)
        except TypeError:
            new = msgpack.ExtType(2, msgpack.packb([str(new)]))  # a tuple key instead
        holder[new] = holder.pop(key)
    else:
        holder[key] = d.value()
    raw = msgpack.packb(doc, use_bin_type=True)
    if how == 3:  # duplicate and colliding keys at the raw level: a dict cannot hold them
        pair = d.choice([(b"\xc3", b"\x01"), (b"\x01", b"\xcb" + struct.pack(">d", 1.0)), (b"\xa1k", b"\xa1k"),
                         (b"\xcb" + struct.pack(">d", 0.0), b"\xcb" + struct.pack(">d", -0.0))])
        ctx = msgpack.packb(msgpack.unpackb(state_doc(ck), raw=False, strict_map_key=False)["context"], use_bin_type=True)
        raw = b"\x82\xa5state\x81\xa1x\x82" + pair[0] + b"\xa1T" + pair[1] + b"\xa1I" + b"\xa7context" + ctx
    put_state_doc(ck, raw)
    return True


MUTATORS: dict[str, Callable[[Path, Path, Draw], bool]] = {
    "flip": m_flip,
    "truncate": m_truncate,
    "extend": m_extend,
    "swap-files": m_swap_files,
    "swap-from-other": m_swap_from_other,
    "flip-resigned": m_flip_resigned,
    "manifest-field": m_manifest_field,
    "huge-sizes": m_huge_sizes,
    "hostile-header": m_hostile_header,
    "hostile-tree": m_hostile_tree,
}


# --- the oracle --------------------------------------------------------------------------------------------


class _Mismatch(Exception):
    pass


def _oracle_ext(code: int, data: bytes) -> Any:
    return ("ext", code, bytes(data))


def _oracle_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # spec §7.3: keys equal as values are duplicates, refused
        raise _Mismatch(f"a map with colliding keys was accepted: {[k for k, _ in pairs][:6]!r}")
    return out


def oracle_tree(doc: bytes) -> Any:
    """Plain msgpack decode, extension values kept as ("ext", code, payload); a map
    with colliding keys means the reader should have refused."""
    return msgpack.unpackb(doc, raw=False, strict_map_key=False, ext_hook=_oracle_ext, object_pairs_hook=_oracle_pairs)


def oracle_header(ck: Path) -> None:
    """Spec §6.1 header rules, read independently of ckpt/format/safetensors.py."""
    b = (ck / TENSORS).read_bytes()
    (n,) = struct.unpack_from("<Q", b, 0)
    text = b[8 : 8 + n]
    if n % 8 or not text.startswith(b"{") or text.rstrip(b" ").count(b"}") == 0:
        raise _Mismatch(f"accepted a header of length {n} / padding {text[-8:]!r}")

    def pairs(ps: list[tuple[str, Any]]) -> dict[str, Any]:
        if len(dict(ps)) != len(ps):
            raise _Mismatch("accepted a header with a repeated key")
        return dict(ps)

    body = text.rstrip(b" ")
    h = json.loads(body, object_pairs_hook=pairs)
    for k, v in h.items():
        if k == "__metadata__":
            if type(v) is not dict or any(type(x) is not str for x in v.values()):
                raise _Mismatch("accepted a non-string __metadata__")
            continue
        if set(v) != {"dtype", "shape", "data_offsets"}:
            raise _Mismatch(f"accepted member fields {sorted(v)}")
        if any(type(x) is not int for x in v["shape"] + v["data_offsets"]):
            raise _Mismatch(f"accepted a non-int shape or offset {v}")


def tbytes(t: Any) -> bytes:
    """A tensor's bytes. The contiguous copy is held in a local: tensor_memoryview does
    not keep its tensor alive, so a temporary would be freed before tobytes() ran."""
    from ckpt.writer import tensor_memoryview

    c = t.detach().resolve_conj().resolve_neg().contiguous()
    return tensor_memoryview(c).tobytes()


def _same_float(a: float, b: float) -> bool:
    return struct.pack("<d", a) == struct.pack("<d", b)


def compare(got: Any, want: Any, tensors: Callable[[str], bytes], where: str = "") -> None:
    """``got``: our reader's value; ``want``: the oracle's. Tensors compared by bytes."""
    import torch

    from ckpt.format import dtypes

    if isinstance(want, tuple) and len(want) == 3 and want[0] == "ext":
        code, payload = want[1], want[2]
        if code == 1:
            if not isinstance(got, torch.Tensor):
                raise _Mismatch(f"{where}: expected a tensor, got {type(got).__name__}")
            if tbytes(got) != tensors(payload.decode()):
                raise _Mismatch(f"{where}: tensor bytes differ from stock safetensors")
            return
        if code == 2:
            inner = oracle_tree(payload)
            if type(got) is not tuple or not isinstance(inner, list) or len(got) != len(inner):
                raise _Mismatch(f"{where}: tuple")
            for i, (g, w) in enumerate(zip(got, inner)):
                compare(g, w, tensors, f"{where}/{i}")
            return
        if code == 3:
            if not (isinstance(got, torch.dtype) and dtypes.dtype_name(got) == payload.decode()):
                raise _Mismatch(f"{where}: dtype")
            return
        if code == 4:
            text = payload.decode("utf-8", "replace")
            if not all(c in "0123456789" for c in text.lstrip("-")) or text in ("", "-"):
                raise _Mismatch(f"{where}: accepted a BIGINT that is not ASCII decimal: {text[:20]!r}")
            if str(int(text)) != text or -(2**63) <= int(text) < 2**64:
                raise _Mismatch(f"{where}: accepted a non-canonical BIGINT {text[:20]!r}")
            if got != int(text) or type(got) is not int:
                raise _Mismatch(f"{where}: bigint {got!r} vs {text!r}")
            return
        if code == 6:
            if not (isinstance(got, torch.device) and str(got) == payload.decode()):
                raise _Mismatch(f"{where}: device {got!r} vs {payload!r}")
            return
        raise _Mismatch(f"{where}: extension {code} accepted")
    if isinstance(want, dict):
        if type(got) is not dict or len(got) != len(want):
            raise _Mismatch(f"{where}: map")
        for (gk, gv), (wk, wv) in zip(got.items(), want.items()):
            if isinstance(wk, tuple) and wk and wk[0] == "ext":
                compare(gk, wk, tensors, f"{where}/<key>")
            elif type(gk) is not type(wk) or (gk != wk and not (type(gk) is float and _same_float(gk, wk))):
                raise _Mismatch(f"{where}: key {gk!r} vs {wk!r}")
            compare(gv, wv, tensors, f"{where}/{gk}")
        return
    if isinstance(want, list):
        if type(got) is not list or len(got) != len(want):
            raise _Mismatch(f"{where}: list")
        for i, (g, w) in enumerate(zip(got, want)):
            compare(g, w, tensors, f"{where}/{i}")
        return
    if type(got) is not type(want):
        raise _Mismatch(f"{where}: {type(got).__name__} vs {type(want).__name__}")
    if isinstance(want, float):
        if not _same_float(got, want):
            raise _Mismatch(f"{where}: float bits")
    elif got != want:
        raise _Mismatch(f"{where}: {got!r} vs {want!r}")


def stock_tensors(ck: Path) -> Callable[[str], bytes]:
    """Tensor bytes as stock safetensors reads them (raises if it refuses the file)."""
    from safetensors import safe_open

    f = safe_open(str(ck / TENSORS), framework="pt")

    def get(key: str) -> bytes:
        return tbytes(f.get_tensor(key))

    return get


# --- running a case ------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # exact | refused | wrong | other | hang
    mutator: str
    detail: str = ""


class _Hang(BaseException):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def on_alarm(signum: int, frame: Any) -> None:
        raise _Hang()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _documented(e: BaseException) -> bool:
    from ckpt.errors import CkptError

    try:
        from replay.errors import ReplayError, TapeError

        return isinstance(e, (CkptError, TapeError, ReplayError))
    except ImportError:  # pragma: no cover
        return isinstance(e, CkptError)


def load_everything(ck: Path) -> tuple[Any, dict[str, bytes], Any]:
    """Open, verify, read every tensor lazily, and the whole state fresh."""
    import ckpt

    r = ckpt.open(ck)
    r.verify()
    lazy = {t.key: tbytes(r.tensor(t.key)) for t in r.tensor_entries()}
    state = r.state()
    return r, lazy, state


class Fuzzer:
    """Builds two small real checkpoints once; each case mutates a fresh copy."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base = root / "base" / "step-00000001"
        self.other = root / "other" / "step-00000001"
        _build(self.base, seed=1)
        _build(self.other, seed=2)
        self.original = load_everything(self.base)
        self.n = 0

    def case(self, name: str, draw: Draw, *, timeout: float = 20.0) -> Outcome:
        self.n += 1
        work = self.root / f"case-{self.n}"
        ck = work / "step-00000001"
        shutil.copytree(self.base, ck)
        try:
            try:
                with time_limit(timeout):
                    resigned = MUTATORS[name](ck, self.other, draw)
                    try:
                        _, lazy, state = load_everything(ck)
                    except _Hang:
                        raise
                    except BaseException as e:
                        if _documented(e):
                            return Outcome("refused", name, f"{type(e).__name__}: {str(e)[:160]}")
                        return Outcome("other", name, "".join(traceback.format_exception(e))[-1500:])
                    return self._judge(name, ck, resigned, lazy, state)
            except _Hang:
                return Outcome("hang", name, f"over {timeout}s")
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _judge(self, name: str, ck: Path, resigned: bool, lazy: dict[str, bytes], state: Any) -> Outcome:
        try:
            if not resigned:
                _, want_lazy, want_state = self.original
                if lazy != want_lazy:
                    raise _Mismatch("tensors differ from the original without re-signing")
                _compare_loaded(state, want_state)
            else:
                try:
                    tensors = stock_tensors(ck)
                except Exception as e:  # stock refuses what we loaded
                    raise _Mismatch(f"stock safetensors refuses a file we loaded: {e}") from None
                oracle_header(ck)
                for key, b in lazy.items():
                    if tensors(key) != b:
                        raise _Mismatch(f"lazy tensor {key} differs from stock safetensors")
                doc = oracle_tree(state_doc(ck) if _codec(ck) else (ck / STATE).read_bytes())
                compare(state, doc["state"], tensors, "state")
        except _Mismatch as e:
            return Outcome("wrong", name, str(e))
        return Outcome("exact", name)


def _codec(ck: Path) -> bool:
    body = read_body(ck)
    return next(f[5] for f in body["parts"][0]["files"] if f[0] == STATE) is not None


def _compare_loaded(got: Any, want: Any) -> None:
    import torch

    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            raise _Mismatch("tensor kind")
        if tbytes(got) != tbytes(want):
            raise _Mismatch("tensor bytes")
        return
    if isinstance(want, dict):
        if type(got) is not dict or list(got) != list(want):
            raise _Mismatch("map keys")
        for k in want:
            _compare_loaded(got[k], want[k])
        return
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            raise _Mismatch("sequence")
        for g, w in zip(got, want):
            _compare_loaded(g, w)
        return
    if type(got) is not type(want) or (got != want and not (isinstance(got, float) and _same_float(got, want))):
        raise _Mismatch(f"value {got!r} vs {want!r}")


def _build(path: Path, *, seed: int) -> None:
    """A small checkpoint with several dtypes and every kind of plain value."""
    import torch

    import ckpt
    from ckpt.knobs import override

    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(3, generator=g)
    state = {
        "model": {
            "w": torch.randn(40, 30, generator=g),  # spans chunks of 4096 bytes
            "b": torch.randn(30, generator=g).to(torch.float64),
            "i": torch.arange(7, dtype=torch.int16) * seed,
            "flags": torch.tensor([True, False, True]),
            "c": torch.randn(2, generator=g).to(torch.complex128),
            "empty": torch.zeros(0, 3),
        },
        "tree": {
            "n": None, "t": True, "i": -7 * seed, "big": 2**70 + seed, "f": -0.0, "nan": math.nan, "s": "héllo",
            "b": b"\x00\xff", "tup": (1, (2.5, "x")), "ik": {1: "one", (1, 2): "pair", 2.5: "f"},
            "dtype": torch.bfloat16, "dev": torch.device("cpu"), "tied": [shared, shared],
        },
    }
    with override(chunk_size=CHUNK):
        ckpt.save(path, state, step=1)


# --- the long run ------------------------------------------------------------------------------------------------


def tapes_module() -> Any:
    """bench/fuzz_tapes.py, loaded by path (bench/ is not a package)."""
    import importlib.util

    name = "ckpt_fuzz_tapes"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("fuzz_tapes.py"))
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main(argv: list[str] | None = None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--case-timeout", type=float, default=30.0)
    ap.add_argument("--tape-cases", type=int, default=None, help="tape cases (default: a quarter of --cases)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    counts: dict[str, int] = {}
    by_mutator: dict[str, dict[str, int]] = {}
    bad: list[Outcome] = []
    t0 = time.monotonic()
    rss0 = peak_rss_mib()
    with tempfile.TemporaryDirectory(prefix="ckpt-fuzz-") as tmp:
        fz = Fuzzer(Path(tmp))
        names = sorted(MUTATORS)
        for i in range(args.cases):
            name = names[i % len(names)]
            out = fz.case(name, RandomDraw(rng), timeout=args.case_timeout)
            counts[out.kind] = counts.get(out.kind, 0) + 1
            by_mutator.setdefault(name, {}).setdefault(out.kind, 0)
            by_mutator[name][out.kind] += 1
            if out.kind in ("wrong", "other", "hang"):
                bad.append(out)
        n_tape = args.cases // 4 if args.tape_cases is None else args.tape_cases
        tape_counts, tape_bad = tapes_module().run(sys.modules[__name__], Path(tmp) / "tapes", n_tape, rng,
                                                   timeout=args.case_timeout)
        bad += tape_bad
    elapsed = time.monotonic() - t0
    print(f"checkpoint cases tried: {sum(counts.values())}  ({elapsed:.0f} s, seed {args.seed})")
    print(f"  loaded bit-exact:      {counts.get('exact', 0)}")
    print(f"  refused cleanly:       {counts.get('refused', 0)}")
    print(f"  silent wrong data:     {counts.get('wrong', 0)}")
    print(f"  other exceptions:      {counts.get('other', 0)}")
    print(f"  hangs:                 {counts.get('hang', 0)}")
    for name in sorted(by_mutator):
        print(f"    {name:16s} " + "  ".join(f"{k} {v}" for k, v in sorted(by_mutator[name].items())))
    if tape_counts:
        print(f"tape cases tried: {sum(tape_counts.values())}")
        print(f"  read exact:            {tape_counts.get('exact', 0)}")
        print(f"  refused cleanly:       {tape_counts.get('refused', 0)}")
        print(f"  silent wrong data:     {tape_counts.get('wrong', 0)}")
        print(f"  other exceptions:      {tape_counts.get('other', 0)}")
        print(f"  hangs:                 {tape_counts.get('hang', 0)}")
    print(f"peak RSS: {peak_rss_mib():.0f} MiB (start {rss0:.0f} MiB)")
    for out in bad[:20]:
        print(f"--- {out.kind} in {out.mutator}:\n{out.detail}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
