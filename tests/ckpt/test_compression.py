"""Opt-in tensor compression (format 2.0 packed files, BPZ1 byte planes + zstd; spec/format-2.md §V.3).

The codec round-trips every element size at every block edge; a compressed save loads exactly
through every read path (lazy tensor, fresh state, mapped state, in place) and verifies; lazy
reads touch only the chunks of the tensor's span; stock safetensors still reads the unencoded
tensors, and `ckpt inspect` says which it cannot; hostile spans are refused before their bytes
are decompressed, within the memory the checkpoint legitimately declares.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.errors import FormatError, LimitExceededError
from ckpt.format import bpz
from ckpt.knobs import override
from ckpt.storage import LocalStorage
from tests.ckpt.test_hostile_memory import SLACK, probe
import hangs

REPO = Path(__file__).resolve().parents[2]
V2 = REPO / "spec" / "vectors" / "checkpoint-v2"


@settings(max_examples=60, deadline=None)
@given(
    itemsize=st.sampled_from([1, 2, 4, 8, 16]),
    elements=st.integers(1, 3000),
    block_k=st.integers(1, 3),
    kind=st.sampled_from(["noise", "smooth", "zeros"]),
    cut=st.integers(1, 5000),
)
def test_bpz_round_trips_any_values_in_any_pieces(itemsize: int, elements: int, block_k: int, kind: str, cut: int) -> None:
    g = torch.Generator().manual_seed(elements)
    n = elements * itemsize
    if kind == "noise":
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
    elif kind == "zeros":
        raw = bytes(n)
    else:
        raw = (torch.linspace(-1, 1, n // 4 + 1) * 0.02).numpy().tobytes()[:n]
    block = 4096 * block_k
    span = bpz.encode(raw, itemsize, block=block)
    assert bytes(bpz.decode(span, n, itemsize)) == raw
    out = bytearray(n)
    dec = bpz.SpanDecoder(memoryview(out), itemsize, len(span))
    for i in range(0, len(span), cut):  # pieces of any size, blocks split anywhere
        dec.feed(span[i : i + cut])
    dec.finish()
    assert bytes(out) == raw


def test_bpz_decoder_refuses_spans_that_break_its_rules() -> None:
    raw = (torch.randn(4096) * 0.02).numpy().tobytes()
    span = bpz.encode(raw, 4)
    with pytest.raises(FormatError, match="past the span"):
        bpz.decode(span[:-1], len(raw), 4)
    dec = bpz.SpanDecoder(memoryview(bytearray(len(raw))), 4, len(span))
    dec.feed(span[:-1])
    with pytest.raises(FormatError, match="span ends"):
        dec.finish()
    with pytest.raises(FormatError, match="bytes after the last block"):
        bpz.decode(span + b"\0", len(raw), 4)
    with pytest.raises(FormatError, match="more than the span"):
        bpz.SpanDecoder(memoryview(bytearray(len(raw))), 4, len(span)).feed(span + b"\0")
    with pytest.raises(FormatError, match="planes for a dtype"):
        bpz.decode(span, len(raw), 2)  # the header's E is the dtype's itemsize
    with pytest.raises(LimitExceededError, match="expansion"):
        bpz.SpanDecoder(None, 4, 16, nbytes=1 << 30, sink=lambda b: None)  # 1 GiB of values from 16 bytes


def _trained_like(dtype: torch.dtype, n: int = 1 << 20) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(n, generator=g) * 0.02).to(dtype)


@pytest.mark.parametrize("dtype,target", [(torch.float32, 1.15), (torch.bfloat16, 1.4)])
def test_compression_meets_its_ratio_targets_on_weight_like_tensors(tmp_path: Path, dtype: torch.dtype, target: float) -> None:
    t = _trained_like(dtype)
    ckpt.save(tmp_path / "c", {"w": {"t": t}}, compress=True)
    pf = tmp_path / "c" / "rank-00000.bpz"
    ratio = t.numel() * t.element_size() / pf.stat().st_size
    assert ratio >= target, ratio


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "w32": torch.randn(300, 100, generator=g) * 0.02,
            "w16": (torch.randn(40000, generator=g) * 0.02).to(torch.bfloat16),
            "h16": (torch.randn(40000, generator=g)).to(torch.float16),
            "w64": torch.randn(9000, generator=g, dtype=torch.float64),
            "c64": torch.randn(9000, generator=g, dtype=torch.complex64),
            "small": torch.randn(10, generator=g),
            "ids": torch.arange(20000),
        },
        "other": {"w": torch.randn(20000, generator=g), "step": 4},
    }


def _same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    else:
        assert a == b


def test_a_compressed_save_loads_exactly_every_way(tmp_path: Path) -> None:
    state = _state()
    info = ckpt.save(tmp_path / "c", state, compress=lambda key, dtype, n: key != "model/small")
    r = ckpt.open(info.path)
    assert r.manifest.version == (2, 0)
    enc = {t.key for t in r.part().tensors if t.encoding == "bpz1"}
    assert enc == {"model/w32", "model/w16", "model/h16", "model/w64", "model/c64", "model/ids", "other/w"}
    r.verify()
    for key in ("model/w32", "model/c64", "model/ids"):
        top, name = key.split("/")
        _same(r.tensor(key), state[top][name])
    _same(r.state(), state)
    _same(r.state(unsafe_mmap=True), state)
    target = {k: {n: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for n, v in d.items()} for k, d in state.items()}
    ptrs = {n: v.data_ptr() for n, v in target["model"].items()}
    ckpt.load(info.path, target, exactness="off")
    _same(target, state)
    assert {n: v.data_ptr() for n, v in target["model"].items()} == ptrs  # in place


def test_compress_picks_entries_and_float_tensors_and_the_default_stays_1_0(tmp_path: Path) -> None:
    state = _state()
    plain = ckpt.save(tmp_path / "plain", state)
    assert ckpt.open(plain.path).manifest.version == (1, 0)
    assert sorted(os.listdir(plain.path)) == ["MANIFEST", "rank-00000.safetensors", "rank-00000.state.msgpack.zst"]
    by_entry = ckpt.open(ckpt.save(tmp_path / "e", state, compress=["other"]).path)
    assert {t.key for t in by_entry.part().tensors if t.encoding} == {"other/w"}
    floats = ckpt.open(ckpt.save(tmp_path / "f", state, compress=True).path)
    # floats of at least 64 KiB: not the int64 ids, not the 40-byte tensor, not complex
    assert {t.key for t in floats.part().tensors if t.encoding} == {"model/w32", "model/w16", "model/h16", "model/w64", "other/w"}
    with pytest.raises(TypeError):
        ckpt.save(tmp_path / "s", state, compress="model")


def test_stock_safetensors_reads_the_unencoded_tensors_and_inspect_names_the_rest(tmp_path: Path) -> None:
    import safetensors.torch

    state = _state()
    info = ckpt.save(tmp_path / "c", state, compress=True)
    stock = safetensors.torch.load_file(os.path.join(info.path, "rank-00000.safetensors"))
    assert set(stock) == {"model/small", "model/ids", "model/c64"}
    assert torch.equal(stock["model/ids"], state["model"]["ids"])
    out = hangs.run([sys.executable, "-m", "ckpt_cli.main", "inspect", info.path], cwd=REPO, bound_s=hangs.hang_s(6))
    assert out.returncode == 0, out.stderr
    assert "format 2.0" in out.stdout and "5 tensors encoded" in out.stdout
    assert "stock safetensors cannot read them" in out.stdout
    js = json.loads(hangs.run([sys.executable, "-m", "ckpt_cli.main", "inspect", "--json", info.path], cwd=REPO,
                              bound_s=hangs.hang_s(6)).stdout)
    assert js["parts"][0]["packed"]["tensors"] == 5


class _CountingStorage(LocalStorage):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, int, int]] = []

    def pread_into(self, path: str, offset: int, buf: memoryview) -> int:
        self.reads.append((os.path.basename(path), offset, len(buf)))
        return super().pread_into(path, offset, buf)


def test_a_lazy_read_reads_only_the_chunks_of_its_span(tmp_path: Path) -> None:
    state = {"m": {f"t{i}": torch.randn(3000) for i in range(6)}}
    with override(chunk_size=4096, bpz_block=4096):
        info = ckpt.save(tmp_path / "c", state, compress=lambda k, d, n: True)
    storage = _CountingStorage()
    r = ckpt.open(info.path, storage=storage)
    t = next(e for e in r.part().tensors if e.key == "m/t3")
    f = r.part().files[t.file]
    assert f.size > 4 * t.stored  # other spans lie around it
    storage.reads.clear()
    assert torch.equal(r.tensor("m/t3"), state["m"]["t3"])
    lo, hi = t.offset // 4096 * 4096, -(-(t.offset + t.stored) // 4096) * 4096
    spans = [(o, o + n) for name, o, n in storage.reads if name == f.name]
    assert spans and all(lo <= a and b <= hi for a, b in spans), (spans, lo, hi)
    assert sum(b - a for a, b in spans) <= hi - lo


def test_a_flipped_bit_in_a_packed_span_is_a_checksum_error_not_a_decoding_one(tmp_path: Path) -> None:
    info = ckpt.save(tmp_path / "c", {"m": {"w": _trained_like(torch.float32, 1 << 16)}}, compress=True)
    pf = Path(info.path) / "rank-00000.bpz"
    data = bytearray(pf.read_bytes())
    data[17] ^= 0xFF  # the first block's first plane codec: the decoder alone would call it reserved
    pf.write_bytes(bytes(data))
    r = ckpt.open(info.path)
    with pytest.raises(ckpt.errors.ChecksumMismatchError) as ei:
        r.tensor("m/w")
    assert isinstance(ei.value.__context__, FormatError) or ei.value.__context__ is None
    with pytest.raises(ckpt.errors.ChecksumMismatchError):
        r.verify()
    with pytest.raises(ckpt.errors.ChecksumMismatchError):
        ckpt.open(info.path).state()  # the one-pass decode of the whole packed file
    target = {"m": {"w": torch.zeros(1 << 16)}}
    with pytest.raises(ckpt.errors.ChecksumMismatchError):
        ckpt.load(info.path, target, exactness="off")
    assert not target["m"]["w"].any()  # all or nothing: the target was not written


@pytest.mark.slow
def test_hostile_planes_are_refused_before_allocation() -> None:
    def vector(name: str) -> Path:
        return V2 / name / json.loads((V2 / name / "expected.json").read_text())["path"]

    with pytest.raises(FormatError, match="declares 1073741824 bytes, the plane has 1024"):
        ckpt.open(vector("invalid-zstd-plane-claims-1-gib")).tensor("model/w32")
    with pytest.raises(FormatError, match="stored length 1 does not fit a 40000-byte plane"):
        ckpt.open(vector("invalid-plane-expansion-bound")).tensor("mask/zeros")
    # in a fresh interpreter: the frame's claim of 1 GiB never turns into memory
    for row in probe(vector("invalid-zstd-plane-claims-1-gib"), "tensor", key="model/w32"):
        assert row["outcome"] == "FormatError" and row["growth"] < SLACK, row


# --- the encoder's recycled block buffers (encode_many(reuse=True), FileSink.write_copy) ---------


_FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("threads", [0, 2])
def test_recycled_block_buffers_give_the_same_bytes_as_fresh_ones(threads: int) -> None:
    """Many more blocks than buffers in flight, every float dtype, sizes that end mid-block
    and mid-plane, noise next to values that compress: each item's pieces are copied out
    before the next is asked for (what write_copy does), and the bytes equal the fresh-
    buffer encoding, which decodes to the values exactly."""
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(11)
    tensors = []
    for i, dt in enumerate(_FLOAT_DTYPES * 3):
        n = 4096 * (3 + i) // dt.itemsize + (i * 7) % 5  # not a multiple of the block
        t = (torch.randn(n, generator=g) * 0.02).to(dt)
        if i % 3 == 2:
            t = torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int16).to(dt)  # large values: other exponents
        tensors.append(t)
    items = [(memoryview(t.view(torch.uint8).numpy()), t.element_size()) for t in tensors]

    def spans(reuse: bool) -> list[bytes]:
        out: list[bytearray] = [bytearray() for _ in items]
        pool = ThreadPoolExecutor(threads) if threads else None
        try:
            for i, pieces in bpz.encode_many(items, block=8192, pool=pool, reuse=reuse):
                for b in pieces:
                    out[i] += memoryview(b).cast("B")  # consumed before the next item
        finally:
            if pool is not None:
                pool.shutdown()
        return [bytes(s) for s in out]

    fresh, recycled = spans(False), spans(True)
    assert recycled == fresh
    for t, span in zip(tensors, recycled):
        raw = t.view(torch.uint8).numpy().tobytes()
        back = torch.frombuffer(bytearray(bpz.decode(span, len(raw), t.element_size())), dtype=t.dtype)
        assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


class _KeepingSink:
    """A sink that keeps every buffer until close (as an upload does): write_copy copies."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.held = inner, []

    def write(self, data: Any) -> None:
        self.held.append(data)

    def write_copy(self, data: Any) -> None:
        self.held.append(bytes(memoryview(data).cast("B")))

    def seal(self) -> None:
        return None

    def flush(self) -> None:
        pass  # an upload holds its buffers until close

    def close(self) -> tuple[int, bytes]:
        for b in self.held:
            self.inner.write(b)
        return self.inner.close()

    def discard(self) -> None:
        self.inner.discard()


class _KeepingStorage(LocalStorage):
    def create(self, path: str, chunk_size: int, *, durable: bool = True) -> Any:
        return _KeepingSink(super().create(path, chunk_size, durable=durable))


@pytest.mark.parametrize("dtype", _FLOAT_DTYPES)
def test_a_packed_file_is_the_same_through_a_recycling_and_a_keeping_sink(tmp_path: Path, dtype: torch.dtype) -> None:
    """Odd sizes across chunk and block boundaries (small knobs), through the local sink's
    write_copy (consumed at once) and through a sink that keeps a copy of every recycled
    buffer until close: identical packed files, and each loads exactly."""
    g = torch.Generator().manual_seed(5)
    state = {"m": {f"t{i}": (torch.randn(n, generator=g) * 0.02).to(dtype) for i, n in enumerate((70001, 123457, 9999, 50000))}}
    with override(bpz_block=16384, chunk_size=8192, compress_min_bytes=1):
        a = ckpt.save(tmp_path / "a", state, compress=True)
        b = ckpt.save(tmp_path / "b", state, compress=True, storage=_KeepingStorage())
    pa, pb = Path(a.path) / "rank-00000.bpz", Path(b.path) / "rank-00000.bpz"
    assert pa.read_bytes() == pb.read_bytes()
    for info in (a, b):
        r = ckpt.open(info.path)
        r.verify()
        _same(r.state(), state)


def test_write_copy_consumes_the_buffer_and_keeps_the_order(tmp_path: Path) -> None:
    """Gathered small writes, a big write hashed on the second thread, then write_copy: the
    file and its digests are those of the bytes in order, though each buffer handed to
    write_copy is overwritten as soon as the call returns."""
    from ckpt.format.digest import ChunkHasher

    storage = LocalStorage()
    pieces = [os.urandom(n) for n in (10, 300_000, 5, 9 << 20, 77, 1 << 20)]
    sink = storage.create(str(tmp_path / "f"), 65536)
    scratch = bytearray(max(map(len, pieces)))
    for i, p in enumerate(pieces):
        if i in (1, 4, 5):
            mv = memoryview(scratch)[: len(p)]
            mv[:] = p
            sink.write_copy(mv)
            mv[:] = bytes(len(p))  # reused at once
        else:
            sink.write(p)
    size, digests = sink.close()
    whole = b"".join(pieces)
    assert (tmp_path / "f").read_bytes() == whole and size == len(whole)
    h = ChunkHasher(65536)
    h.update(whole)
    assert digests == h.finish()


def test_blocks_decode_on_the_codec_threads_exactly_and_errors_still_surface() -> None:
    """SpanDecoder(pool=...): pieces of any size (blocks split across pieces, the caller's
    piece buffer reused after each feed), every float dtype, the same values as inline
    decoding; a damaged zstd frame in a middle block is a FormatError naming that block
    (at a later feed or at finish), and wait() leaves no job running."""
    pool = bpz.shared_pool(2)
    g = torch.Generator().manual_seed(9)
    for dt in _FLOAT_DTYPES:
        t = (torch.randn(40000 // dt.itemsize * 7 + 3, generator=g) * 0.02).to(dt)
        raw = t.view(torch.uint8).numpy().tobytes()
        span = bpz.encode(raw, t.element_size(), block=8192)
        for cut in (1000, 8192, 65536):
            out = bytearray(len(raw))
            dec = bpz.SpanDecoder(memoryview(out), t.element_size(), len(span), pool=pool)
            piece = bytearray(cut)
            for i in range(0, len(span), cut):
                n = min(cut, len(span) - i)
                piece[:n] = span[i : i + n]
                dec.feed(memoryview(piece)[:n])
                piece[:n] = bytes(n)  # the caller reuses its buffer at once
            dec.finish()
            assert bytes(out) == raw, (dt, cut)
    # damage the zstd frame of block 3 (its header still checks out)
    raw = (torch.randn(50000, generator=g) * 0.02).numpy().tobytes()
    span = bytearray(bpz.encode(raw, 4, block=8192))
    pos, b = bpz.HEADER_SIZE, 0
    while True:
        codecs, lengths = span[pos : pos + 4], struct.unpack_from("<4I", span, pos + 4)
        if b == 3:
            z = pos + 20 + sum(lengths[:3])
            assert codecs[3] == 1
            span[z + 8 : z + 24] = b"\xff" * 16  # inside the frame, past its header
            break
        pos += 20 + sum(lengths)
        b += 1
    dec = bpz.SpanDecoder(memoryview(bytearray(len(raw))), 4, len(span), pool=pool)
    with pytest.raises(FormatError, match="block 3 plane 3"):
        dec.feed(span)
        dec.finish()
    dec.wait()
    assert not dec._jobs


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="per-thread nice is a POSIX/Linux notion")
def test_codec_threads_keep_the_priority_of_the_thread_that_saves() -> None:
    """An async save's worker runs at a higher nice value than training (save_thread_nice):
    the codec threads its encoding uses must too, and a pool it created must not demote
    a save on the training thread (one pool per nice value)."""
    import threading

    def nice_of(pool: Any) -> int:
        return pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()

    mine = bpz.shared_pool(2)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    got: dict[str, Any] = {}

    def worker() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, base + 10))
        got["pool"] = bpz.shared_pool(2)
        got["nice"] = nice_of(got["pool"])

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert got["pool"] is not mine and got["nice"] == min(19, base + 10)
    assert bpz.shared_pool(2) is mine and nice_of(mine) == base
