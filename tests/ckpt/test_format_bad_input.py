"""Adversarial input: every malformed checkpoint raises one specific, documented error.

Each case asserts the exception class (exactly, where the reader has one answer) and
that the message names the file and the offset or key. Nothing may load wrong data,
crash the interpreter or allocate in proportion to a size an attacker declared.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import msgpack
import pytest
import torch

import ckpt
from ckpt.errors import (
    ChecksumMismatchError,
    CheckpointNotFoundError,
    CkptError,
    FormatError,
    IncompleteCheckpointError,
    IntegrityError,
    LimitExceededError,
    MissingFileError,
    SizeMismatchError,
    UnexpectedFileError,
    UnsafePathError,
    UnsupportedVersionError,
)
from ckpt.format.codec import zstd_compress
from ckpt.format.digest import ChunkHasher, digest_bytes
from ckpt.format.manifest import MAGIC, MANIFEST_NAME, Manifest, content_id, decode_manifest, encode_manifest
from ckpt.format.tree import EXT_BIGINT, EXT_TENSOR, EXT_TUPLE
from ckpt.knobs import override
import hangs

REPO = Path(__file__).resolve().parents[2]
CS = 4096
ST = "rank-00000.safetensors"
SF = "rank-00000.state.msgpack.zst"


# --- building and tampering --------------------------------------------------------------------------


def small_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(1500, generator=g), "b": torch.arange(700, dtype=torch.int16), "s": torch.tensor(2.5)},
        "meta": {"step": 3, "name": "x"},
    }


def make_ckpt(path: Path, state: dict[str, Any] | None = None, **kw: Any) -> Path:
    kw.setdefault("code_dir", str(path.parent))
    with override(chunk_size=CS):
        ckpt.save(path, small_state() if state is None else state, step=3, **kw)
    return path


@pytest.fixture()
def good(tmp_path: Path) -> Path:
    return make_ckpt(tmp_path / "run" / "step-00000003")


def manifest_of(p: Path) -> Manifest:
    return decode_manifest((p / MANIFEST_NAME).read_bytes())


def write_manifest(p: Path, m: Manifest) -> None:
    (p / MANIFEST_NAME).write_bytes(encode_manifest(m))


def reseal(p: Path, name: str, data: bytes, *, raw_size: int | None = None) -> None:
    """Replace file ``name`` and re-sign the manifest for it: size, chunk digests, id.

    This is what an attacker (or a buggy writer) who controls the whole directory can
    do; the checks that remain are the ones that do not depend on digests.
    """
    (p / name).write_bytes(data)
    m = manifest_of(p)
    h = ChunkHasher(CS)
    h.update(data)
    digests = h.finish()
    parts = []
    for pe in m.parts:
        files = []
        for f in pe.files:
            if f.name == name:
                f = dataclasses.replace(f, size=len(data), digests=digests, raw_size=raw_size if raw_size is not None else f.raw_size)
            files.append(f)
        parts.append(dataclasses.replace(pe, files=tuple(files)))
    parts_t = tuple(parts)
    write_manifest(p, dataclasses.replace(m, parts=parts_t, id=content_id(parts_t)))


def raw_body(p: Path) -> dict[str, Any]:
    data = (p / MANIFEST_NAME).read_bytes()
    (n,) = struct.unpack_from("<Q", data, 16)
    return msgpack.unpackb(data[24 : 24 + n], raw=False, strict_map_key=False)


def _reid(body: dict[str, Any]) -> None:
    cid = body.get("id")
    if not (isinstance(cid, str) and len(cid) == 32):
        return  # a test about the id itself
    try:
        wire = [[p["name"], [[f[0], f[2], f[4]] for f in p["files"]]] for p in sorted(body["parts"], key=lambda p: p["name"])]
    except (KeyError, IndexError, TypeError):
        return
    body["id"] = digest_bytes(msgpack.packb(wire, use_bin_type=True)).hex()


def hand_manifest(body: Any, *, magic: bytes = MAGIC, major: int = 1, minor: int = 0, flags: int = 0, body_bytes: bytes | None = None) -> bytes:
    """A MANIFEST built byte by byte with struct, independent of encode_manifest.

    A well-formed body gets its content id recomputed, as a writer would, so that the
    case under test is the one refused (the reader checks the id against the parts).
    """
    if body_bytes is None and isinstance(body, dict):
        _reid(body)
    b = msgpack.packb(body, use_bin_type=True) if body_bytes is None else body_bytes
    head = struct.pack("<8sHHIQ", magic, major, minor, flags, len(b))
    return head + b + digest_bytes(head + b)


def flip(path: Path, pos: int, bit: int = 0) -> None:
    with open(path, "r+b") as fh:
        fh.seek(pos)
        byte = fh.read(1)[0]
        fh.seek(pos)
        fh.write(bytes([byte ^ (1 << bit)]))


def names_file(e: BaseException, name: str) -> None:
    assert isinstance(e, CkptError)
    assert e.path is not None and os.path.basename(e.path) == name, (e.path, name)
    assert f"file {e.path}" in str(e)


def names_where(e: CkptError) -> None:
    assert e.offset is not None or e.key is not None, str(e)
    assert ("offset " in str(e)) or ("key " in str(e)), str(e)


def load_everything(p: Path) -> None:
    """Every read path; each must raise on corrupt data (none may return it)."""
    r = ckpt.open(p)
    r.verify()


# --- truncation ----------------------------------------------------------------------------------------------


def test_manifest_truncated_at_every_offset(good: Path) -> None:
    data = (good / MANIFEST_NAME).read_bytes()
    assert 200 < len(data) < 20_000
    for cut in range(len(data)):
        (good / MANIFEST_NAME).write_bytes(data[:cut])
        with pytest.raises(FormatError) as ei:
            ckpt.open(good)
        assert type(ei.value) is FormatError, (cut, ei.value)
        names_file(ei.value, MANIFEST_NAME)
        assert ei.value.offset is not None and ei.value.offset <= cut


def _sample_offsets(p: Path, name: str) -> list[int]:
    size = (p / name).stat().st_size
    offs = {0, 7, 8, size // 2, size - 1, CS, CS - 1}
    if name == ST:
        (n,) = struct.unpack("<Q", (p / name).read_bytes()[:8])
        offs |= {8 + n - 1, 8 + n, 8 + n + 1}
    return sorted(o for o in offs if 0 <= o < size)


@pytest.mark.parametrize("name", [ST, SF])
def test_data_files_truncated_at_sampled_offsets(tmp_path: Path, name: str) -> None:
    p0 = make_ckpt(tmp_path / "orig")
    for cut in _sample_offsets(p0, name):
        p = tmp_path / f"cut-{cut}"
        shutil.copytree(p0, p)
        data = (p / name).read_bytes()
        (p / name).write_bytes(data[:cut])
        with pytest.raises(SizeMismatchError) as ei:
            ckpt.open(p)
        names_file(ei.value, name)
        assert ei.value.offset == cut
        # Re-signed manifest: sizes and digests agree, so only the parsers stand guard.
        reseal(p, name, data[:cut])
        with pytest.raises(FormatError) as ei:
            ckpt.open(p).verify()
        e = ei.value
        assert isinstance(e, FormatError), (cut, e)
        names_where(e)


def test_state_file_truncation_is_caught_by_the_zstd_and_msgpack_parsers(tmp_path: Path) -> None:
    p0 = make_ckpt(tmp_path / "orig")
    data = (p0 / SF).read_bytes()
    for cut in _sample_offsets(p0, SF):
        p = tmp_path / f"cut-{cut}"
        shutil.copytree(p0, p)
        reseal(p, SF, data[:cut])
        r = ckpt.open(p)  # sizes agree; structure is parsed on first use
        with pytest.raises(FormatError) as ei:
            r.context()
        assert type(ei.value) is FormatError
        names_file(ei.value, SF)


def test_safetensors_shorter_than_its_prefix_or_header(tmp_path: Path) -> None:
    p = make_ckpt(tmp_path / "c")
    data = (p / ST).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    for cut, msg in ((5, "8-byte length prefix"), (8 + n - 3, f"claims {n} bytes but the file has")):
        q = tmp_path / f"cut{cut}"
        shutil.copytree(p, q)
        body = raw_body(q)
        body["parts"][0]["tensors"] = []  # a manifest that no longer points into the data
        (q / ST).write_bytes(data[:cut])
        body["parts"][0]["files"][1][2] = cut
        h = ChunkHasher(CS)
        h.update(data[:cut])
        body["parts"][0]["files"][1][4] = h.finish()
        (q / MANIFEST_NAME).write_bytes(hand_manifest(body))
        with pytest.raises(FormatError, match=msg) as ei:
            ckpt.open(q).verify()
        names_file(ei.value, ST)
        names_where(ei.value)


# --- bit flips -------------------------------------------------------------------------------------------------------


def test_manifest_bit_flip_at_every_byte_is_refused(good: Path) -> None:
    data = (good / MANIFEST_NAME).read_bytes()
    kinds: set[str] = set()
    for pos in range(len(data)):
        bits = range(8) if pos < 24 else (pos % 8,)  # every bit of the fixed header
        for bit in bits:
            b = bytearray(data)
            b[pos] ^= 1 << bit
            (good / MANIFEST_NAME).write_bytes(bytes(b))
            with pytest.raises((FormatError, ChecksumMismatchError)) as ei:
                ckpt.open(good)
            names_file(ei.value, MANIFEST_NAME)
            names_where(ei.value)
            kinds.add(type(ei.value).__name__)
    assert kinds == {"FormatError", "UnsupportedVersionError", "LimitExceededError", "ChecksumMismatchError"}


@pytest.mark.parametrize("name", [ST, SF])
def test_data_file_bit_flips_never_load_wrong_data(tmp_path: Path, name: str) -> None:
    p0 = make_ckpt(tmp_path / "orig")
    size = (p0 / name).stat().st_size
    rng = random.Random(f"flip-{name}")
    positions = sorted({0, 3, 8, 9, size // 3, size // 2, size - 1, *rng.sample(range(size), 12)})
    for pos in positions:
        p = tmp_path / f"flip-{pos}"
        shutil.copytree(p0, p)
        flip(p / name, pos, bit=pos % 8)
        r = ckpt.open(p)  # sizes are intact: open succeeds, reads must not
        with pytest.raises((ChecksumMismatchError, FormatError)) as ei:
            r.verify()
        names_file(ei.value, name)
        names_where(ei.value)
        with pytest.raises((ChecksumMismatchError, FormatError)):
            ckpt.open(p).state()
        target = {"model": {k: torch.zeros_like(v) for k, v in small_state()["model"].items()}, "meta": {}}
        with pytest.raises((ChecksumMismatchError, FormatError)):
            ckpt.load(p, target)
        if isinstance(ei.value, ChecksumMismatchError):
            chunk = ei.value.context["chunk"]
            assert ei.value.offset == chunk * CS and chunk == pos // CS
        shutil.rmtree(p)


def test_verify_false_is_an_explicit_opt_out(good: Path) -> None:
    r = ckpt.open(good)
    e = next(t for t in r.part().tensors if t.key == "model/w")
    flip(good / ST, e.offset + 4 * 10 + 3, bit=6)
    with pytest.raises(ChecksumMismatchError, match="key 'model/w'"):
        ckpt.open(good).tensor("model/w")
    got = ckpt.open(good).tensor("model/w", verify=False)
    assert not torch.equal(got, small_state()["model"]["w"])


# --- missing, extra, wrong kinds of files -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", [ST, SF])
def test_missing_file(good: Path, name: str) -> None:
    os.unlink(good / name)
    with pytest.raises(MissingFileError) as ei:
        ckpt.open(good)
    names_file(ei.value, name)
    assert isinstance(ei.value, IntegrityError) and isinstance(ei.value, ValueError)


@pytest.mark.parametrize("extra", ["junk.bin", ".DS_Store", "rank-00001.safetensors", "subdir"])
def test_extra_file(good: Path, extra: str) -> None:
    if extra == "subdir":
        (good / extra).mkdir()
    else:
        (good / extra).write_bytes(b"x")
    with pytest.raises(UnexpectedFileError) as ei:
        ckpt.open(good)
    names_file(ei.value, extra)
    assert extra in str(ei.value)


def test_checkpoint_file_replaced_by_symlink_outside(tmp_path: Path) -> None:
    for name in (ST, SF, MANIFEST_NAME):
        p = make_ckpt(tmp_path / f"c-{name}")
        outside = tmp_path / f"outside-{name}"
        shutil.copyfile(p / name, outside)  # same bytes, same size: only the link is wrong
        os.unlink(p / name)
        os.symlink(outside, p / name)
        with pytest.raises(UnsafePathError) as ei:
            ckpt.open(p)
        names_file(ei.value, name)
    # a directory where a file should be
    p = make_ckpt(tmp_path / "c-dir")
    os.unlink(p / ST)
    (p / ST).mkdir()
    with pytest.raises(UnsafePathError, match="not a regular file"):
        ckpt.open(p)


def test_symlinked_checkpoint_directory_is_followed_and_contained(good: Path, tmp_path: Path) -> None:
    link = tmp_path / "latest"
    os.symlink(good, link)
    r = ckpt.open(link)
    assert r.path == str(good.resolve())
    r.verify()


# --- magic and version ---------------------------------------------------------------------------------------------------


def test_wrong_magic(good: Path) -> None:
    body = raw_body(good)
    for magic in (b"CKPTMNFX", b"\x00" * 8, b"PK\x03\x04\x00\x00\x00\x00", b"ckptmnft"):
        (good / MANIFEST_NAME).write_bytes(hand_manifest(body, magic=magic))
        with pytest.raises(FormatError, match="bad magic") as ei:
            ckpt.open(good)
        assert type(ei.value) is FormatError and ei.value.offset == 0
        names_file(ei.value, MANIFEST_NAME)


def test_future_major_version_is_refused_before_the_body_is_parsed(good: Path) -> None:
    m = manifest_of(good)
    for version in ((3, 0), (0, 9), (65535, 0)):  # 2 is format-2.md
        write_manifest(good, dataclasses.replace(m, version=version))
        with pytest.raises(UnsupportedVersionError, match=rf"format version {version[0]}\.{version[1]}") as ei:
            ckpt.open(good)
        assert ei.value.offset == 8
        names_file(ei.value, MANIFEST_NAME)
    # by hand: a v3 body this reader could not parse at all is never looked at
    (good / MANIFEST_NAME).write_bytes(hand_manifest(None, major=3, body_bytes=b"\xc1 not msgpack"))
    with pytest.raises(UnsupportedVersionError):
        ckpt.open(good)


def test_future_minor_version_is_read(good: Path) -> None:
    body = raw_body(good)
    body["meta"]["added_in_1_7"] = {"x": 1}  # what a minor version may add: keys under meta/summary
    (good / MANIFEST_NAME).write_bytes(hand_manifest(body, minor=7))
    r = ckpt.open(good)
    assert r.manifest.version == (1, 7) and r.meta["added_in_1_7"] == {"x": 1}
    r.verify()


def test_reserved_flags_must_be_zero(good: Path) -> None:
    (good / MANIFEST_NAME).write_bytes(hand_manifest(raw_body(good), flags=1))
    with pytest.raises(FormatError, match="reserved flags") as ei:
        ckpt.open(good)
    assert ei.value.offset == 12


def test_manifest_body_schema_is_enforced(good: Path) -> None:
    base = raw_body(good)
    cases: list[tuple[Callable[[dict[str, Any]], Any], str]] = [
        (lambda b: b.__setitem__("format", "other"), "format"),
        (lambda b: b.__setitem__("id", "XYZ"), "id"),
        (lambda b: b.__setitem__("kind", "zip"), "kind"),
        (lambda b: b.__setitem__("step", -1), "step"),
        (lambda b: b.__setitem__("step", True), "step"),
        (lambda b: b.__setitem__("created_at", 5), "created_at"),
        (lambda b: b.__setitem__("parts", []), "parts"),
        (lambda b: b["parts"][0]["files"][0].__setitem__(1, "weights"), "parts[0].files[0]"),
        (lambda b: b["parts"][0]["files"][0].__setitem__(5, "lz4"), "parts[0].files[0]"),
        (lambda b: b["parts"][0]["files"][0].__setitem__(3, 100), "parts[0].files[0]"),
        (lambda b: b["parts"][0]["files"][0].__setitem__(4, b"short"), "parts[0].files[0]"),
        (lambda b: b["parts"][0]["files"][1].__setitem__(5, "zstd"), "parts[0].files[1]"),
        (lambda b: b["parts"][0]["files"].pop(0), "parts[0]"),
        (lambda b: b["parts"][0]["tensors"][0].__setitem__(1, "float128"), "parts[0].tensors[0]"),
        (lambda b: b["parts"][0]["tensors"][0].__setitem__(3, 0), "parts[0].tensors[0]"),
        (lambda b: b["parts"][0]["tensors"][0].__setitem__(5, 1), "parts[0].tensors[0]"),
        (lambda b: b["parts"][0]["tensors"][0].__setitem__(2, [-1]), "parts[0].tensors[0]"),
        (lambda b: b["parts"][0]["tensors"][0].__setitem__(2, [1] * 65), "parts[0].tensors[0]"),
        (lambda b: b["parts"][0]["tensors"][0].__setitem__(0, ""), "parts[0].tensors[0]"),
    ]
    for mutate, key in cases:
        body = msgpack.unpackb(msgpack.packb(base, use_bin_type=True), raw=False, strict_map_key=False)
        mutate(body)
        (good / MANIFEST_NAME).write_bytes(hand_manifest(body))
        with pytest.raises(FormatError, match="invalid manifest") as ei:
            ckpt.open(good)
        assert type(ei.value) is FormatError and ei.value.key == key, (key, ei.value)
        names_file(ei.value, MANIFEST_NAME)


# --- absurd sizes and bombs -----------------------------------------------------------------------------------------------


class Bounded:
    """Asserts that the Python heap never grew by more than ``limit`` bytes inside."""

    def __init__(self, limit: int = 32 << 20) -> None:
        self.limit = limit

    def __enter__(self) -> "Bounded":
        tracemalloc.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < self.limit, f"peak Python allocation {peak} bytes"


def test_manifest_claiming_absurd_sizes_allocates_nothing(good: Path) -> None:
    base = raw_body(good)
    data = (good / MANIFEST_NAME).read_bytes()
    # header: body length 2^60
    (good / MANIFEST_NAME).write_bytes(data[:16] + struct.pack("<Q", 1 << 60) + data[24:])
    with Bounded(), pytest.raises(LimitExceededError, match="body") as ei:
        ckpt.open(good)
    assert ei.value.offset == 16
    # body fields: a file of 2^60 bytes, a raw size of 2^60, a tensor of 2^60 elements
    for mutate, key in (
        (lambda b: b["parts"][0]["files"][1].__setitem__(2, 1 << 60), "parts[0].files[1]"),
        (lambda b: b["parts"][0]["files"][0].__setitem__(6, 1 << 60), "parts[0].files[0]"),
        (lambda b: b["parts"][0]["tensors"][0].__setitem__(2, [1 << 60]), "parts[0].tensors[0]"),
        (lambda b: b["parts"][0]["tensors"][0].__setitem__(5, 1 << 62), "parts[0].tensors[0]"),
        (lambda b: b["parts"][0]["files"][1].__setitem__(3, 1 << 60), "parts[0].files[1]"),
    ):
        body = msgpack.unpackb(msgpack.packb(base, use_bin_type=True), raw=False, strict_map_key=False)
        mutate(body)
        (good / MANIFEST_NAME).write_bytes(hand_manifest(body))
        with Bounded(), pytest.raises(FormatError) as ei:
            ckpt.open(good)
        assert ei.value.key == key


def test_plausible_huge_file_size_is_checked_against_the_disk_not_allocated(good: Path) -> None:
    body = raw_body(good)
    size, cs = 1 << 49, 1 << 30  # within the limits; the digest list is 8 MiB
    body["parts"][0]["files"][1][2:5] = [size, cs, b"\x00" * (16 * (size // cs))]
    (good / MANIFEST_NAME).write_bytes(hand_manifest(body))
    with Bounded(64 << 20), pytest.raises(SizeMismatchError) as ei:
        ckpt.open(good)
    names_file(ei.value, ST)


def test_manifest_file_above_the_limit_is_not_read(good: Path) -> None:
    with open(good / MANIFEST_NAME, "r+b") as fh:
        fh.truncate((64 << 20) + 1000)  # sparse: costs no disk
    with Bounded(), pytest.raises(LimitExceededError) as ei:
        ckpt.open(good)
    names_file(ei.value, MANIFEST_NAME)


@pytest.mark.parametrize("declared", [1 << 60, (64 << 20) + 1, 1 << 40])
def test_safetensors_header_claiming_absurd_size(good: Path, declared: int) -> None:
    data = (good / ST).read_bytes()
    forged = struct.pack("<Q", declared) + data[8:]
    for resealed in (False, True):
        if resealed:
            reseal(good, ST, forged)
        else:
            (good / ST).write_bytes(forged)
        with Bounded(), pytest.raises(LimitExceededError, match=f"claims {declared} bytes") as ei:
            ckpt.open(good).verify()
        assert ei.value.offset == 0
        names_file(ei.value, ST)
    # below the limit but beyond the file
    reseal(good, ST, struct.pack("<Q", 60 << 20) + data[8:])
    with Bounded(), pytest.raises(FormatError, match="but the file has"):
        ckpt.open(good).tensor("model/w")


def _state_bomb(good: Path, raw: bytes) -> None:
    reseal(good, SF, zstd_compress(raw), raw_size=len(raw))


@pytest.mark.parametrize(
    "what, raw, err",
    [
        ("deep arrays", b"\x91" * 200_000 + b"\xc0", FormatError),
        ("deep maps", b"\x81\xa1k" * 100_000 + b"\xc0", FormatError),
        ("array32 of 2^32-1", b"\xdd\xff\xff\xff\xff" + b"\xc0" * 16, FormatError),
        ("map32 of 2^32-1", b"\xdf\xff\xff\xff\xff" + b"\xc0" * 16, FormatError),
        ("str32 of 2^32-1", b"\xdb\xff\xff\xff\xff" + b"a" * 16, FormatError),
        ("bin32 of 2^32-1", b"\xc6\xff\xff\xff\xff" + b"a" * 16, FormatError),
        ("ext32 of 2^32-1", b"\xc9\xff\xff\xff\xff\x02" + b"a" * 16, FormatError),
        ("trailing bytes", msgpack.packb({"state": {}, "context": {}}) + b"\xc0", FormatError),
        ("not a map", msgpack.packb([1, 2]), FormatError),
        ("unknown ext", msgpack.packb({"state": {"x": msgpack.ExtType(99, b"")}, "context": {}}), FormatError),
        ("bad bigint", msgpack.packb({"state": {"x": msgpack.ExtType(EXT_BIGINT, b"12a")}, "context": {}}), FormatError),
        ("huge bigint", msgpack.packb({"state": {"x": msgpack.ExtType(EXT_BIGINT, b"9" * 5000)}, "context": {}}), FormatError),
        # ext -1 is decoded by msgpack itself, never through our ext hook
        ("timestamp value", msgpack.packb({"state": {"x": [1, msgpack.Timestamp(5, 0)]}, "context": {}}), FormatError),
        ("timestamp in context", msgpack.packb({"state": {}, "context": {"t": msgpack.Timestamp(1, 2)}}), FormatError),
    ],
)
def test_msgpack_bombs_in_the_state_file(good: Path, what: str, raw: bytes, err: type) -> None:
    _state_bomb(good, raw)
    with Bounded(64 << 20), pytest.raises(err) as ei:
        ckpt.open(good).context()
    names_file(ei.value, SF)


def test_deeply_nested_tuples_hit_the_nesting_limit(good: Path) -> None:
    inner = msgpack.packb([None])  # a tuple's payload is an array
    for _ in range(300):
        inner = msgpack.packb([msgpack.ExtType(EXT_TUPLE, inner)])
    raw = msgpack.packb({"state": {"t": msgpack.ExtType(EXT_TUPLE, inner)}, "context": {}})
    _state_bomb(good, raw)
    with Bounded(), pytest.raises(LimitExceededError, match="nest too deeply") as ei:
        ckpt.open(good).context()
    names_file(ei.value, SF)


def test_tensor_reference_the_manifest_does_not_list(good: Path) -> None:
    context = msgpack.unpackb(msgpack.packb(ckpt.open(good).context(), use_bin_type=True), raw=False)  # a valid §8 context
    raw = msgpack.packb({"state": {"m": msgpack.ExtType(EXT_TENSOR, b"model/nope")}, "context": context}, use_bin_type=True)
    _state_bomb(good, raw)
    with pytest.raises(FormatError, match="does not list") as ei:
        ckpt.open(good).state()
    assert ei.value.key == "model/nope"


def _zstd_frame_claiming(content_size: int) -> bytes:
    # RFC 8878 §3.1.1: magic, Frame_Header_Descriptor (FCS 8 bytes, single segment),
    # Frame_Content_Size, then one last raw block of 0 bytes.
    return struct.pack("<IBQ", 0xFD2FB528, 0b1110_0000, content_size) + b"\x01\x00\x00"


def test_zstd_frame_claiming_a_huge_content_size(good: Path) -> None:
    for claim, raw_size in ((1 << 60, 100), (1 << 29, 1 << 29), (50, 100)):
        reseal(good, SF, _zstd_frame_claiming(claim), raw_size=raw_size)
        with Bounded(), pytest.raises(FormatError) as ei:
            ckpt.open(good).context()
        names_file(ei.value, SF)
    # no declared content size at all (a streaming frame)
    import zstandard

    frame = zstandard.ZstdCompressor(write_content_size=False).compress(msgpack.packb({"state": {}, "context": {}}))
    reseal(good, SF, frame, raw_size=20)
    with pytest.raises(FormatError, match="zstd frame declares"):
        ckpt.open(good).context()
    # a raw size above the limit is refused by the manifest validator before any read
    body = raw_body(good)
    body["parts"][0]["files"][0][6] = (1 << 30) + 1
    (good / MANIFEST_NAME).write_bytes(hand_manifest(body))
    with pytest.raises(FormatError, match="raw_size"):
        ckpt.open(good)


def test_manifest_body_with_a_timestamp_is_refused_by_name(good: Path) -> None:
    body = raw_body(good)
    body["meta"] = {"when": msgpack.Timestamp(1, 0)}
    (good / MANIFEST_NAME).write_bytes(hand_manifest(body))
    with pytest.raises(FormatError, match="extension value at /meta/when") as ei:
        ckpt.open(good)
    names_file(ei.value, MANIFEST_NAME)


def test_manifest_body_bombs(good: Path) -> None:
    stamped = msgpack.packb({"format": msgpack.Timestamp(0, 0)})  # ext -1: decoded by msgpack, not by our hook
    for body_bytes in (b"\x91" * 100_000 + b"\xc0", b"\xdd\xff\xff\xff\xff", b"\xdf\x7f\xff\xff\xff" + b"\xc0" * 8, b"\xc1",
                       stamped):
        (good / MANIFEST_NAME).write_bytes(hand_manifest(None, body_bytes=body_bytes))
        with Bounded(), pytest.raises(FormatError) as ei:
            ckpt.open(good)
        names_file(ei.value, MANIFEST_NAME)


# --- names ---------------------------------------------------------------------------------------------------------------


def test_duplicate_names(good: Path) -> None:
    base = raw_body(good)

    def dup_file(b: dict[str, Any]) -> None:
        b["parts"][0]["files"][1][0] = b["parts"][0]["files"][0][0]

    def dup_part(b: dict[str, Any]) -> None:
        b["parts"].append(b["parts"][0])

    def dup_file_across_parts(b: dict[str, Any]) -> None:
        other = msgpack.unpackb(msgpack.packb(b["parts"][0]), raw=False, strict_map_key=False)
        other["name"] = "rank-00001"
        b["parts"].append(other)

    def dup_tensor(b: dict[str, Any]) -> None:
        b["parts"][0]["tensors"][1][0] = b["parts"][0]["tensors"][0][0]

    for mutate, msg in (
        (dup_file, "duplicate file name"),
        (dup_part, "duplicate part name"),
        (dup_file_across_parts, "duplicate file name"),
        (dup_tensor, "duplicate tensor key"),
    ):
        body = msgpack.unpackb(msgpack.packb(base, use_bin_type=True), raw=False, strict_map_key=False)
        mutate(body)
        (good / MANIFEST_NAME).write_bytes(hand_manifest(body))
        with pytest.raises(FormatError, match=msg) as ei:
            ckpt.open(good)
        assert type(ei.value) is FormatError
        names_file(ei.value, MANIFEST_NAME)
        names_where(ei.value)


BAD_NAMES = ["../x", "/etc/passwd", "a/b", ".hidden", "..", ".", "", "MANIFEST", "a\x00b", "a\\b", "x" * 300, "ü", "-rf"]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_unsafe_names_in_the_manifest(good: Path, bad: str) -> None:
    for where in ("file", "part"):
        body = raw_body(good)
        if where == "file":
            body["parts"][0]["files"][1][0] = bad
        else:
            body["parts"][0]["name"] = bad
        (good / MANIFEST_NAME).write_bytes(hand_manifest(body))
        with pytest.raises(UnsafePathError) as ei:
            ckpt.open(good)
        names_file(ei.value, MANIFEST_NAME)
        assert ei.value.key == bad[:80]
        assert isinstance(ei.value, FormatError)


def test_unsafe_checkpoint_and_part_names_are_refused_by_the_writer(tmp_path: Path) -> None:
    for bad in (".hidden", ".tmp-x"):
        with pytest.raises(UnsafePathError):
            make_ckpt(tmp_path / bad)
    pending = ckpt.begin(tmp_path / "ok")
    try:
        with pytest.raises(UnsafePathError):
            ckpt.write_part(pending, "../evil", {})
    finally:
        ckpt.abort(pending)
    assert os.listdir(tmp_path) == []


# --- not a committed checkpoint ---------------------------------------------------------------------------------------------


def test_uncommitted_and_missing_checkpoints(tmp_path: Path, good: Path) -> None:
    tmpdir = good.parent / ".tmp-step-00000004-abcdef012345"
    shutil.copytree(good, tmpdir)  # even a complete-looking temporary directory
    with pytest.raises(IncompleteCheckpointError, match="temporary") as ei:
        ckpt.open(tmpdir)
    names_file(ei.value, tmpdir.name)
    os.symlink(tmpdir, tmp_path / "latest")  # a link to a temporary directory is no way in
    with pytest.raises(IncompleteCheckpointError, match="temporary"):
        ckpt.open(tmp_path / "latest")
    nomanifest = good.parent / "step-00000005"
    shutil.copytree(good, nomanifest)
    os.unlink(nomanifest / MANIFEST_NAME)
    with pytest.raises(IncompleteCheckpointError, match="no MANIFEST"):
        ckpt.open(nomanifest)
    with pytest.raises(IncompleteCheckpointError):
        ckpt.load(nomanifest, {})
    (tmp_path / "empty").mkdir()
    with pytest.raises(IncompleteCheckpointError):
        ckpt.open(tmp_path / "empty")
    with pytest.raises(CheckpointNotFoundError) as ei2:
        ckpt.open(tmp_path / "does-not-exist")
    assert isinstance(ei2.value, FileNotFoundError) and "does-not-exist" in str(ei2.value)
    (tmp_path / "a-file").write_bytes(b"x")
    with pytest.raises(FormatError, match="directory"):
        ckpt.open(tmp_path / "a-file")
    with pytest.raises(CheckpointNotFoundError):
        ckpt.load(tmp_path / "does-not-exist", {})


# --- crash safety -------------------------------------------------------------------------------------------------------------

BIG = 5 << 20  # float32 elements: 20 MiB


def big_state(v: float) -> dict[str, Any]:
    a = torch.arange(BIG, dtype=torch.float32)
    a[0] = v
    return {"w": {"a": a, "b": torch.full((1000,), v, dtype=torch.float64)}, "step": int(v)}


def assert_run_dir_sound(run: Path, first: Path) -> None:
    want = big_state(1.0)
    got = ckpt.open(first).state()
    assert torch.equal(got["w"]["a"], want["w"]["a"]) and torch.equal(got["w"]["b"], want["w"]["b"])
    for name in sorted(os.listdir(run)):
        p = run / name
        if name.startswith(".tmp-"):
            with pytest.raises(IncompleteCheckpointError):
                ckpt.open(p)
            continue
        r = ckpt.open(p)  # anything under a final name is complete and intact
        r.verify()
        step = r.state()["step"]
        assert torch.equal(r.tensor("w/b"), torch.full((1000,), float(step), dtype=torch.float64))


CHILD = textwrap.dedent(
    """
    import os, sys, torch, ckpt
    run = sys.argv[1]
    a = torch.arange({big}, dtype=torch.float32)
    print("ready", flush=True)
    for i in range(2, 10):
        a[0] = i
        ckpt.save(os.path.join(run, f"step-{{i:05d}}"), {{"w": {{"a": a, "b": torch.full((1000,), float(i), dtype=torch.float64)}}, "step": i}}, code_dir=run)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigkill_at_random_moments_leaves_previous_checkpoints_loadable(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(big=BIG))
    rng = random.Random(20240601)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for round_ in range(3):
        run = tmp_path / f"run{round_}"
        first = make_ckpt(run / "step-00001", big_state(1.0))
        proc = subprocess.Popen([sys.executable, str(script), str(run)], stdout=subprocess.PIPE, env=env)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
            time.sleep(rng.uniform(0.0, 0.5))
        finally:
            proc.send_signal(signal.SIGKILL)
            hangs.communicate(proc, bound_s=hangs.hang_s(6))
            if proc.stdout is not None:
                proc.stdout.close()
        assert_run_dir_sound(run, first)
        shutil.rmtree(run)


@pytest.mark.parametrize("fail_at", [1, 2, 3, 4])
def test_write_error_mid_save_leaves_nothing_half_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int) -> None:
    run = tmp_path / "run"
    first = make_ckpt(run / "step-00001", big_state(1.0))
    real_write, real_writev = os.write, os.writev
    calls = [0]

    def failing(real: Any) -> Any:
        # write and writev (small pieces are gathered into one writev) share one count
        def call(fd: int, data: Any) -> int:
            calls[0] += 1
            if calls[0] == fail_at:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return real(fd, data)

        return call

    monkeypatch.setattr(os, "write", failing(real_write))
    monkeypatch.setattr(os, "writev", failing(real_writev))
    with pytest.raises(OSError, match="injected"):
        make_ckpt(run / "step-00002", big_state(2.0))
    monkeypatch.undo()
    assert sorted(os.listdir(run)) == ["step-00001"]  # the temporary directory was removed
    assert_run_dir_sound(run, first)


@pytest.mark.parametrize("target", ["fsync", "rename"])
def test_fsync_or_rename_failure_mid_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    run = tmp_path / "run"
    first = make_ckpt(run / "step-00001", big_state(1.0))

    def failing(*a: Any, **k: Any) -> Any:
        raise OSError(errno.EIO, f"{target} failed (injected)")

    monkeypatch.setattr(os, target, failing)
    if target == "rename":
        # The commit publishes with renameat2(2) through ctypes where it exists: fail that too.
        import ctypes

        import ckpt.storage.posix

        def failing_renameat2(*a: Any) -> int:
            ctypes.set_errno(errno.EIO)
            return -1

        monkeypatch.setattr(ckpt.storage.posix, "_renameat2", failing_renameat2)
    with pytest.raises(OSError, match="injected" if target == "fsync" else "injected|Input/output error"):
        make_ckpt(run / "step-00002", big_state(2.0))
    monkeypatch.undo()
    assert sorted(os.listdir(run)) == ["step-00001"]
    assert_run_dir_sound(run, first)


def test_pipelined_verification_reports_the_bad_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large parts hash on a second thread; a flipped bit still fails the load, naming the chunk."""
    import ckpt._ranges as reader_mod

    monkeypatch.setattr(reader_mod, "PIPELINE_MIN_BYTES", 0)
    import torch

    with ckpt.knobs.override(chunk_size=4096):
        ckpt.save(tmp_path / "c", {"m": {"a": torch.arange(5000, dtype=torch.float32), "b": torch.ones(3000)}}, step=0)
        path = tmp_path / "c" / "rank-00000.safetensors"
        size = path.stat().st_size
        flip(path, size - 100)
        target = {"m": {"a": torch.zeros(5000), "b": torch.zeros(3000)}}
        with pytest.raises(ChecksumMismatchError, match=r"chunk \d+ \(bytes") as ei:
            ckpt.load(tmp_path / "c", target, restore_rng=False, exactness="off")
        assert ei.value.path.endswith("rank-00000.safetensors")
        assert ei.value.offset <= size - 100 < ei.value.offset + 4096
        fresh = ckpt.open(tmp_path / "c")
        with pytest.raises(ChecksumMismatchError):
            fresh.state()


def test_a_manifest_nesting_past_the_limit_is_refused_and_never_written(tmp_path: Path) -> None:
    """spec §4.2: a MANIFEST nests at most 256 containers (meta and summary are free-form);
    readers refused nothing before, and a writer wrote whatever meta it was given."""
    from tests.ckpt._manifest_kit import manifest_body, sign_manifest
    from ckpt.errors import LimitExceededError

    ck = tmp_path / "c"
    ckpt.save(ck, {"w": torch.ones(2)}, step=1)
    deep: Any = "bottom"
    for _ in range(300):
        deep = [deep]
    body = manifest_body(ck)
    body["meta"] = {"deep": deep}
    sign_manifest(ck, body)
    with pytest.raises(LimitExceededError, match="nests deeper than 256 containers"):
        ckpt.open(ck)
    pending = ckpt.begin(tmp_path / "d")
    part = ckpt.write_part(pending, "rank-00000", {"w": torch.ones(2)}, step=1)
    with pytest.raises(LimitExceededError, match="nests deeper than 256"):
        ckpt.commit(pending, [part], meta={"deep": deep})
    assert not (tmp_path / "d").exists()
