"""The fast write path: gathered small writes, early writeback, the text-built header.

Speed is measured in bench/save_load.py; these tests pin that the fast path writes the
same bytes the plain one would: a stock safetensors file, digests that match the bytes
on disk, whatever the mix of small and large tensors and however the kernel splits the
writes.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckpt
from ckpt.format import dtypes
from ckpt.format.digest import ChunkHasher
from ckpt.format.safetensors import TensorSlot, build_header, build_header_rows
from ckpt.knobs import override
from ckpt.storage import posix


def _json_header(rows: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None) -> tuple[bytes, list[int]]:
    """The header as json.dumps writes it: what build_header_rows must equal byte for byte."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    pos, rel = 0, []
    for key, dt, shape, nbytes in rows:
        shp = [nbytes] if dtypes.is_raw(dt) else list(shape)
        header[key] = {"dtype": dtypes.safetensors_name(dt), "shape": shp, "data_offsets": [pos, pos + nbytes]}
        rel.append(pos)
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, [8 + len(raw) + r for r in rel]


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt", "writer": 'ckpt-replay "0.1" \\ é'}])
def test_the_text_built_header_is_byte_identical_to_json_dumps(metadata: dict[str, str] | None) -> None:
    rows = [
        ('quote"back\\slash/é\u2028\x01\x7f', "float32", (2, 3), 24),
        ("raw complex", "complex128", (2,), 32),
        ("scalar", "float32", (), 4),
        ("empty", "bfloat16", (0, 5), 0),
        ("bits", "float8_e8m0fnu", (7,), 7),
        ("big", "int64", (1 << 20, 3), 3 << 23),
    ]
    assert build_header_rows(rows, metadata) == _json_header(rows, metadata)
    assert build_header([TensorSlot(*r) for r in rows], metadata) == _json_header(rows, metadata)
    assert build_header_rows([], metadata) == _json_header([], metadata)


def _mixed_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    small = {f"s{i:04d}": torch.randn(int(torch.randint(1, 300, (1,), generator=g)), generator=g) for i in range(1500)}
    big = torch.randn(3 << 20, generator=g)  # 12 MiB: hashed on the second thread, written in pieces
    mid = torch.randn(70_000, generator=g)  # 280 KiB: just above the gathering threshold
    return {"small": small, "big": big, "mid": mid, "ints": torch.arange(5000, dtype=torch.int16), "after": torch.ones(3)}


def _check_file_and_digests(path: Path, state: dict[str, Any]) -> None:
    r = ckpt.open(path)
    r.verify()  # every chunk digest against the bytes on disk
    got = r.state()
    assert set(got) == set(state)
    for k in state["small"]:
        assert torch.equal(got["small"][k], state["small"][k]), k
    for k in ("big", "mid", "ints", "after"):
        assert torch.equal(got[k], state[k]), k
    f = r.part().file("tensors")
    stock = load_file(str(path / f.name))  # a stock safetensors file
    assert len(stock) == 1504
    hasher = ChunkHasher(f.chunk_size)
    hasher.update((path / f.name).read_bytes())
    assert hasher.finish() == f.digests


def test_many_small_tensors_mixed_with_large_ones_round_trip(tmp_path: Path) -> None:
    state = _mixed_state()
    ckpt.save(tmp_path / "c", state, step=1)
    _check_file_and_digests(tmp_path / "c", state)


def test_short_writes_and_writevs_still_write_every_byte_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write, real_writev = os.write, os.writev
    calls = {"writev": 0}

    def short_write(fd: int, data: Any) -> int:
        return real_write(fd, memoryview(data)[: 100_003])

    def short_writev(fd: int, bufs: list[Any]) -> int:
        calls["writev"] += 1
        # the kernel may stop anywhere, even inside a buffer
        out, budget = [], 5_001
        for b in bufs:
            mv = memoryview(b)
            if budget <= 0:
                break
            out.append(mv[:budget])
            budget -= len(mv)
        return real_writev(fd, out)

    monkeypatch.setattr(os, "write", short_write)
    monkeypatch.setattr(os, "writev", short_writev)
    state = _mixed_state()
    ckpt.save(tmp_path / "c", state, step=1)
    monkeypatch.undo()
    assert calls["writev"] > 10
    _check_file_and_digests(tmp_path / "c", state)


@pytest.mark.parametrize("writeback", [0, 4096, 1 << 20])
def test_early_writeback_at_any_interval_or_off_writes_the_same_file(tmp_path: Path, writeback: int) -> None:
    state = _mixed_state()
    with override(writeback_bytes=writeback, chunk_size=1 << 16):
        ckpt.save(tmp_path / "c", state, step=1)
    _check_file_and_digests(tmp_path / "c", state)


def test_a_failing_writeback_hint_does_not_fail_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kicks = []
    monkeypatch.setattr(posix, "_sync_file_range", lambda *a: (kicks.append(a), -1)[1])
    state = _mixed_state()
    ckpt.save(tmp_path / "c", state, step=1)
    assert kicks  # it was asked, failed, and the fsync in close() made the file durable anyway
    _check_file_and_digests(tmp_path / "c", state)


def test_the_many_small_writes_take_few_system_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {"write": 0, "writev": 0}
    real_write, real_writev = os.write, os.writev
    monkeypatch.setattr(os, "write", lambda fd, d: (counts.__setitem__("write", counts["write"] + 1), real_write(fd, d))[1])
    monkeypatch.setattr(os, "writev", lambda fd, b: (counts.__setitem__("writev", counts["writev"] + 1), real_writev(fd, b))[1])
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(4000)}
    ckpt.save(tmp_path / "c", state, step=1)
    # 4000 tensors + header gathered into writevs of <= 512 buffers; state file and MANIFEST one each
    assert counts["write"] == 0 and counts["writev"] <= 8 + 2 + 1, counts
    got = ckpt.open(tmp_path / "c").state()
    assert all(torch.equal(got[f"t{i}"], state[f"t{i}"]) for i in range(4000))


def test_tied_and_aliased_views_are_still_stored_once(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32)
    view = base[2:8]
    other_shape = base.view(3, 4)
    state = {"a": base, "b": base, "v": view, "v2": base[2:8], "s": other_shape, "c": base.conj()}
    ckpt.save(tmp_path / "c", state, step=1)
    r = ckpt.open(tmp_path / "c")
    keys = {t.key for t in r.tensor_entries()}
    # base once, the [2:8] view once (reached twice), the reshaped view once; a real tensor's conj is itself
    assert len(keys) == 3, keys
    got = r.state()
    assert got["a"] is got["b"] and got["v"] is got["v2"]
    assert torch.equal(got["s"], other_shape) and torch.equal(got["v"], view)
