"""Peak memory on hostile files stays within 64 MiB of the legitimate data they declare.

Each hostile checkpoint is small on disk (sparse files, or a few KiB that claim much
more). A fresh interpreter opens and reads it; the peak RSS growth (``ru_maxrss``) of
that process, measured around the read, must stay below the bytes the checkpoint can
legitimately make a reader hold (the tensors or decoded document it declares and
really contains) plus 64 MiB.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import pytest
import torch
import xxhash
import zstandard

import ckpt
from tests.ckpt._manifest_kit import manifest_body, sign_manifest
from ckpt.knobs import override
import hangs

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
SLACK = 64 * MiB

_PROBE = textwrap.dedent(
    """
    import json, resource, sys
    import ckpt, torch  # imported before the baseline
    from ckpt.writer import tensor_memoryview
    path, key, actions = sys.argv[1], sys.argv[2], sys.argv[3:]
    def rss():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    base = rss()
    for action in actions:  # ru_maxrss is a peak: each figure covers every action so far
        outcome = "ok"
        try:
            r = ckpt.open(path)
            if action == "verify":
                r.verify()
            elif action == "tensor":
                r.tensor(key)
            elif action == "state":
                r.tree()
        except ckpt.errors.CkptError as e:
            outcome = type(e).__name__
        print(json.dumps({"action": action, "growth": rss() - base, "outcome": outcome}))
    """
)


def probe(path: Path, *actions: str, key: str = "") -> list[dict]:
    out = hangs.run(
        [sys.executable, "-c", _PROBE, str(path), key, *actions], cwd=REPO, capture_output=True, text=True, bound_s=hangs.hang_s(30)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.strip().splitlines()]


def _digests(path: Path, chunk: int) -> bytes:
    out = []
    with open(path, "rb") as f:
        while True:
            b = f.read(min(chunk, 64 * MiB))
            if not b:
                break
            h = xxhash.xxh3_128()
            h.update(b)
            got = len(b)
            while got < chunk:
                more = f.read(min(chunk - got, 64 * MiB))
                if not more:
                    break
                h.update(more)
                got += len(more)
            out.append(h.digest())
    return b"".join(out)




def _resign(ck: Path, *, chunk: int | None = None, raw_size: dict[str, int] | None = None) -> None:
    body = manifest_body(ck)
    for f in body["parts"][0]["files"]:
        if chunk is not None:
            f[3] = chunk
        f[2] = os.path.getsize(ck / f[0])
        f[4] = _digests(ck / f[0], f[3])
        if raw_size and f[0] in raw_size:
            f[6] = raw_size[f[0]]
    sign_manifest(ck, body)


@pytest.fixture()
def small(tmp_path: Path) -> Path:
    ck = tmp_path / "step-1"
    with override(chunk_size=4096):
        ckpt.save(ck, {"m": {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3)}}, step=1)
    return ck


@pytest.mark.slow
def test_a_manifest_declaring_1_gib_chunks(small: Path) -> None:
    _resign(small, chunk=1 << 30)
    for got in probe(small, "verify", "tensor", "state", key="m/w"):
        assert got["outcome"] == "ok" and got["growth"] <= SLACK, got


@pytest.mark.slow
def test_a_zstd_state_file_inflating_past_its_document(small: Path) -> None:
    """256 MiB of output from a few hundred KiB of frame, declared honestly: the reader
    may hold the 256 MiB it declares, not a second copy of it."""
    sf = small / "rank-00000.state.msgpack.zst"
    doc = zstandard.ZstdDecompressor().decompress(sf.read_bytes())
    raw = doc + b"\x00" * (256 * MiB)  # trailing bytes after the document: refused after decompression
    sf.write_bytes(zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw))
    _resign(small, raw_size={sf.name: len(raw)})
    (got,) = probe(small, "state")
    assert got["outcome"] == "FormatError", got
    assert got["growth"] <= len(raw) + SLACK, got


@pytest.mark.slow
def test_a_zstd_frame_claiming_the_limit_that_holds_nothing(small: Path) -> None:
    sf = small / "rank-00000.state.msgpack.zst"
    sf.write_bytes(struct.pack("<IBQ", 0xFD2FB528, 0b1110_0000, 1 << 30) + b"\x01\x00\x00")
    _resign(small, raw_size={sf.name: 1 << 30})
    (got,) = probe(small, "state")
    assert got["outcome"] == "FormatError" and got["growth"] <= SLACK, got


@pytest.mark.slow
def test_a_sparse_tensor_file_read_one_small_tensor(tmp_path: Path) -> None:
    """A 256 MiB tensor file with next to nothing on disk, one 256 MiB chunk, re-signed:
    a lazy read of a 12-byte tensor, and a full verify, hold a bounded buffer, not the
    chunk."""
    ck = tmp_path / "step-1"
    with override(chunk_size=4096):
        ckpt.save(ck, {"m": {"small": torch.ones(3), "big": torch.zeros(4)}}, step=1)
    tf = ck / "rank-00000.safetensors"
    big = (256 * MiB) - 4096
    header = {"m/small": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
              "m/big": {"dtype": "F32", "shape": [big // 4], "data_offsets": [12, 12 + big]}}
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    with open(tf, "wb") as f:
        f.write(struct.pack("<Q", len(hj)) + hj + struct.pack("<3f", 1, 1, 1))
        f.truncate(8 + len(hj) + 12 + big)
    if os.stat(tf).st_blocks * 512 > 64 * MiB:
        pytest.skip("this filesystem does not make sparse files")
    body = manifest_body(ck)
    start = 8 + len(hj)
    body["parts"][0]["tensors"] = [["m/small", "float32", [3], 1, start, 12], ["m/big", "float32", [big // 4], 1, start + 12, big]]
    sign_manifest(ck, body)
    _resign(ck, chunk=256 * MiB)
    for got in probe(ck, "tensor", "verify", key="m/small"):
        assert got["outcome"] == "ok" and got["growth"] <= SLACK, got


@pytest.mark.slow
def test_a_sparse_uncompressed_state_file_above_the_limit(small: Path) -> None:
    """Codec nil: the state file is the document, so its size is bound by the 1 GiB
    document limit whatever the disk holds; refused before reading."""
    sf = small / "rank-00000.state.msgpack.zst"
    doc = zstandard.ZstdDecompressor().decompress(sf.read_bytes())
    with open(sf, "wb") as f:
        f.write(doc)
        f.truncate((1 << 30) + (32 << 20))
    body = manifest_body(small)
    for f in body["parts"][0]["files"]:
        if f[0] == sf.name:
            f[5] = None
            f[6] = None
            f[3] = 1 << 30
    sign_manifest(small, body)
    _resign(small)
    (got,) = probe(small, "state")
    assert got["outcome"] == "FormatError" and got["growth"] <= SLACK, got


@pytest.mark.slow
def test_a_state_file_of_empty_arrays_is_bounded_by_the_container_limit(small: Path) -> None:
    """2^24 one-byte empty arrays (16 MiB, a few KiB compressed) made 3.6 GiB of lists:
    each is within msgpack's per-container limits. Knobs.max_containers bounds how many
    a document builds, so memory stays within a small multiple of the document."""
    sf = small / "rank-00000.state.msgpack.zst"
    n = 1 << 24
    doc = (b"\x82" + msgpack.packb("state") + b"\x81" + msgpack.packb("x") + b"\xdd" + n.to_bytes(4, "big")
           + b"\x90" * n + msgpack.packb("context") + b"\x80")
    sf.write_bytes(zstandard.ZstdCompressor(level=3, write_content_size=True).compress(doc))
    assert sf.stat().st_size < 64 * 1024
    _resign(small, raw_size={sf.name: len(doc)})
    (got,) = probe(small, "state")
    assert got["outcome"] == "LimitExceededError", got
    # the document (16 MiB), msgpack's slots for the outer array (8 bytes per input byte)
    # and max_containers empty lists: a multiple of the document plus a constant
    assert got["growth"] <= 10 * len(doc) + SLACK, got


def test_the_container_limit_counts_arrays_maps_and_tuples_of_one_document() -> None:
    from ckpt.errors import LimitExceededError
    from ckpt.format.codec import unpackb
    from ckpt.format.tree import decode_tree, to_wire

    with override(max_containers=10):
        assert unpackb(msgpack.packb([[]] * 4 + [{}] * 5)) == [[]] * 4 + [{}] * 5  # 10 containers: at the limit
        with pytest.raises(LimitExceededError, match="more than 10 arrays and maps"):
            unpackb(msgpack.packb([[]] * 10))
        with pytest.raises(LimitExceededError, match="more than 10 arrays and maps"):
            unpackb(msgpack.packb([{}] * 10))
        body = msgpack.packb(to_wire({"state": {"t": tuple((i,) for i in range(8))}, "context": {}},
                                     lambda v, where: None), use_bin_type=True)
        with pytest.raises(LimitExceededError):  # 9 tuples (arrays in their own payloads) + 3 maps
            decode_tree(body)


@pytest.mark.slow
def test_a_small_state_file_holding_a_huge_bin_is_not_copied(small: Path) -> None:
    """A few KiB of zstd frame declaring (honestly) a document of one 256 MiB bin: decoding
    copied the bin out of the document, so the reader held twice the declared size. A
    value is at most Knobs.value_ratio times the file (or value_floor): refused before the
    copy, so the reader holds the document it declares and no second copy."""
    sf = small / "rank-00000.state.msgpack.zst"
    # the checkpoint's own document (a valid context), with one more entry: a 256 MiB bin
    tree = msgpack.unpackb(zstandard.ZstdDecompressor().decompress(sf.read_bytes()), raw=False,
                           strict_map_key=False, ext_hook=msgpack.ExtType)
    tree["state"]["b"] = bytes(256 * MiB)
    doc = msgpack.packb(tree, use_bin_type=True)
    del tree
    sf.write_bytes(zstandard.ZstdCompressor(level=3, write_content_size=True).compress(doc))
    assert sf.stat().st_size < 128 * 1024
    _resign(small, raw_size={sf.name: len(doc)})
    (got,) = probe(small, "state")
    assert got["outcome"] == "FormatError", got  # on 3930a40: "ok", after holding 2 x 256 MiB
    assert got["growth"] <= len(doc) + SLACK, got


@pytest.mark.slow
def test_a_state_that_compresses_past_the_value_ratio_is_stored_uncompressed(tmp_path: Path) -> None:
    """The writer never writes what the reader refuses: a state whose zstd frame would be
    more than value_ratio times smaller than a value in it is stored with codec nil."""
    blob = bytes(80 * MiB)  # above value_floor, compresses ~10000-fold
    ckpt.save(tmp_path / "c", {"s": {"blob": blob, "n": 1}}, step=1)
    r = ckpt.open(tmp_path / "c")
    (state_file,) = [f for f in r.manifest.parts[0].files if f.role == "state"]
    assert state_file.codec is None and state_file.raw_size is None and state_file.size > len(blob)
    assert r.state()["s"] == {"blob": blob, "n": 1}
    ckpt.save(tmp_path / "d", {"s": {"blob": bytes(1 * MiB)}}, step=1)  # small: compressed as always
    (state_file,) = [f for f in ckpt.open(tmp_path / "d").manifest.parts[0].files if f.role == "state"]
    assert state_file.codec == "zstd"
