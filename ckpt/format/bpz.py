"""BPZ1: a tensor's values split into byte planes, each plane zstd-compressed where it pays.

spec/format-2.md §V.3. Pure: bytes in, bytes out (numpy for the plane shuffle, zstandard for
the planes); no torch, no files. Layout of one span, little-endian::

    span   = header(16) block*            header = "BPZ1" u8 E, 3 zero, u32 R, 4 zero
    block  = u8 codec[E]  u32 len[E]  plane[0] .. plane[E-1]

Block ``b`` covers value bytes ``[b*R, b*R + r_b)``; plane ``p`` holds byte ``p`` of each of
its elements. codec 0 = stored (``len == r_b / E``), 1 = one zstd frame whose declared
content size is the plane length (``1 <= len < r_b / E`` and ``r_b / E <= 32768 * len``).

Why planes: a float's exponent byte has a few common values (low entropy) while its
mantissa bytes are noise; zstd on the whole element sees noise everywhere (about 1.08x on
float32), zstd on the exponent plane alone gets about 2.8x, and skipping the mantissa
planes costs nothing (measured: float32 1.19x, bfloat16 1.47x overall).
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import zstandard

from ..errors import FormatError, LimitExceededError

__all__ = [
    "NAME",
    "MAGIC",
    "HEADER_SIZE",
    "MAX_EXPANSION",
    "MIN_BLOCK",
    "MAX_BLOCK",
    "span_header",
    "encode_blocks",
    "encode_many",
    "encode",
    "SpanDecoder",
    "decode",
    "min_stored",
    "shared_pool",
]

NAME = "bpz1"
MAGIC = b"BPZ1"
_HEADER = struct.Struct("<4sB3sI4s")
HEADER_SIZE = _HEADER.size  # 16
#: a zstd block decodes to at most 128 KiB and costs at least 4 bytes (RFC 8878), so no
#: honest frame expands more: the bound makes decoded sizes a function of stored bytes
MAX_EXPANSION = 32768
MIN_BLOCK = 4096
MAX_BLOCK = 1 << 26
_STORED, _ZSTD = 0, 1
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: a plane is compressed only if it shrinks below this share (else stored)
_TRY_AGAIN = 0.95


def min_stored(nbytes: int) -> int:
    """The fewest stored bytes a span of ``nbytes`` values may have (§V.2.3 bound)."""
    return max(HEADER_SIZE, -(-nbytes // MAX_EXPANSION))


def _compressor() -> zstandard.ZstdCompressor:
    # Level 1, fast strategy, small hash table, long minimum match: exponent planes have
    # low entropy but few long matches, so the time goes to entropy coding, not to match
    # search (measured ~3x faster than plain level 1 on float32 exponent planes, with a
    # slightly better ratio). One compressor per thread: python-zstandard's are not
    # thread-safe.
    params = zstandard.ZstdCompressionParameters(
        compression_level=1,
        strategy=zstandard.STRATEGY_FAST,
        window_log=17,
        hash_log=6,
        min_match=7,
        search_log=1,
        write_content_size=True,
        write_checksum=False,
        write_dict_id=False,
    )
    return zstandard.ZstdCompressor(compression_params=params)


_local = threading.local()


def _thread_compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "compressor", None)
    if c is None:
        c = _local.compressor = _compressor()
    return c


def _thread_decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def span_header(itemsize: int, block: int) -> bytes:
    return _HEADER.pack(MAGIC, itemsize, b"\0\0\0", block, b"\0\0\0\0")


def _check_block_size(itemsize: int, block: int) -> None:
    if not (1 <= itemsize <= 16) or block % itemsize or not (MIN_BLOCK <= block <= MAX_BLOCK):
        raise ValueError(f"BPZ1 block size {block} for {itemsize}-byte elements is out of range")


_PROBE = 16 << 10  # bytes of a plane compressed to decide whether the whole plane pays
#: element sizes split and merged with integer shifts (about 2x a byte-strided transpose)
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_SHIFTS = sys.byteorder == "little"  # plane p is bits 8p.. of the element read as an integer
_SUB = 1 << 18  # elements per sub-block of the split


def _scratch(name: str, n: int, dtype: Any) -> np.ndarray:
    """A per-thread scratch array (warm pages: fresh ones cost a page fault each 4 KiB).
    Its bytes are overwritten by the next use of ``name`` on this thread."""
    bufs = getattr(_local, "scratch", None)
    if bufs is None:
        bufs = _local.scratch = {}
    buf = bufs.get(name)
    need = n * np.dtype(dtype).itemsize
    if buf is None or len(buf) < need:
        buf = bufs[name] = np.empty(need, dtype=np.uint8)
    return buf[:need].view(dtype)


def _split_into(raw: memoryview, e: int, rows: Sequence[np.ndarray]) -> None:
    """Byte plane ``p`` of the values ``raw`` into ``rows[p]`` (uint8, one per element)."""
    n = len(raw) // e
    if _SHIFTS and e in _UINT:
        x = np.frombuffer(raw, dtype=_UINT[e])
        step = min(n, _SUB)
        tmp = _scratch("shift", step, _UINT[e])
        # In sub-blocks, so the shifted copy stays in the cache for its cast (and the
        # scratch stays small).
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            xs, ts = x[lo:hi], tmp[: hi - lo]
            np.copyto(rows[0][lo:hi], xs, casting="unsafe")  # the cast keeps the low byte
            for p in range(1, e):
                np.right_shift(xs, 8 * p, out=ts)
                np.copyto(rows[p][lo:hi], ts, casting="unsafe")
    else:
        grid = np.frombuffer(raw, dtype=np.uint8).reshape(n, e)
        for p in range(e):
            np.copyto(rows[p], grid[:, p])


def _merge(planes: list[Any], e: int, out: memoryview) -> None:
    """Interleave the planes (uint8 arrays or buffers) back into the values ``out``."""
    n = len(out) // e
    if _SHIFTS and e in _UINT:
        ox = np.frombuffer(out, dtype=_UINT[e])
        np.copyto(ox, np.frombuffer(planes[0], dtype=np.uint8), casting="unsafe")
        tmp = _scratch("shift", n, _UINT[e])
        for p in range(1, e):
            np.copyto(tmp, np.frombuffer(planes[p], dtype=np.uint8), casting="unsafe")
            np.left_shift(tmp, 8 * p, out=tmp)
            np.bitwise_or(ox, tmp, out=ox)
    else:
        grid = np.frombuffer(out, dtype=np.uint8).reshape(n, e)
        for p in range(e):
            grid[:, p] = np.frombuffer(planes[p], dtype=np.uint8)


class _Buffers:
    """A free list of block buffers for the stored planes (``encode_many(reuse=True)``).

    Fresh memory is expensive here: glibc hands freed block-sized chunks back to the
    kernel (``madvise``) and every page then faults again on its next use, which cost
    about a third of the encoder's time on two threads (profiled). A buffer is taken by
    an encoder thread and put back by the consumer's generator once the consumer has
    moved on from the block (it must have consumed the bytes by then)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None or len(buf) < nbytes:
            buf = np.empty(max(nbytes, self.size), dtype=np.uint8)
        return buf

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < _KEEP:
                self._free.append(buf)


#: block buffers kept between saves, per block size: about one pipeline window's worth
#: (2 threads: 5 in flight), so a process that saves compressed checkpoints again finds its
#: pages warm (a few tens of MiB, held for the life of the process)
_KEEP = 8
_shared: dict[int, _Buffers] = {}
_shared_lock = threading.Lock()


def _buffers_for(block: int) -> _Buffers:
    with _shared_lock:
        b = _shared.get(block)
        if b is None:
            b = _shared[block] = _Buffers(block)
        return b


def _encode_block(raw: memoryview, itemsize: int, buffers: _Buffers | None = None) -> tuple[list[Any], np.ndarray | None]:
    """One block as a list of buffers (its header, then each plane's bytes), and the block
    buffer the stored planes are in when it came from ``buffers`` (else None). Without
    ``buffers`` the pieces are fresh and never reused: a sink may hold them until it is
    closed (an object-store sink queues them for upload).

    Which planes pay is decided per block from a 16 KiB probe of each plane (the byte of
    the block's first 16 Ki elements; deterministic: the same values always give the same
    bytes), before the block is split: a float32 block then compresses its exponent plane
    and stores its three mantissa planes without spending zstd time on them, and the
    planes to compress are split into this thread's warm scratch (only their compressed
    frames are handed on), not into fresh memory.
    """
    e = itemsize
    n = len(raw) // e
    comp = _thread_compressor()
    if n > _PROBE:
        head = _scratch("probe", e * _PROBE, np.uint8).reshape(e, _PROBE)
        _split_into(raw[: e * _PROBE], e, head)
        squeeze = [len(comp.compress(head[p].data)) < _TRY_AGAIN * _PROBE for p in range(e)]
    else:
        squeeze = [True] * e
    nkept = e - sum(squeeze)
    owned = buffers.take(nkept * n) if buffers is not None and nkept else None
    # stored planes: fresh (see above), or a recycled block buffer
    kept = (owned[: nkept * n] if owned is not None else np.empty(nkept * n, dtype=np.uint8)).reshape(nkept, n)
    warm = _scratch("planes", sum(squeeze) * n, np.uint8).reshape(-1, n)
    rows: list[np.ndarray] = []
    ki = wi = 0
    for p in range(e):
        if squeeze[p]:
            rows.append(warm[wi])
            wi += 1
        else:
            rows.append(kept[ki])
            ki += 1
    _split_into(raw, e, rows)
    codecs = bytearray(e)
    lengths = [n] * e
    payload: list[Any] = []
    for p, row in enumerate(rows):
        z = comp.compress(row.data) if squeeze[p] else None
        if z is not None and len(z) < n and n <= MAX_EXPANSION * len(z):
            codecs[p] = _ZSTD
            lengths[p] = len(z)
            payload.append(z)
        elif squeeze[p]:
            payload.append(bytes(row.data))  # did not pay after all: a fresh copy (scratch is reused)
        else:
            payload.append(row.data)
    return [bytes(codecs) + struct.pack(f"<{e}I", *lengths), *payload], owned


def encode_blocks(
    values: memoryview | bytes,
    itemsize: int,
    *,
    block: int = 4 << 20,
    pool: ThreadPoolExecutor | None = None,
) -> Iterator[list[Any]]:
    """The span of ``values`` as lists of buffers: the header, then each block in order."""
    for _, pieces in encode_many([(values, itemsize)], block=block, pool=pool):
        yield pieces


def encode_many(
    items: Sequence[tuple[memoryview | bytes, int]],
    *,
    block: int = 4 << 20,
    pool: ThreadPoolExecutor | None = None,
    reuse: bool = False,
) -> Iterator[tuple[int, list[Any]]]:
    """The spans of several tensors' values, one after the other, as ``(item index, buffers)``:
    each span's header, then its blocks in order.

    With ``pool`` the blocks are encoded on its threads, a few ahead of the consumer and
    across tensor boundaries (zstd and numpy's copies release the GIL), so writing overlaps
    encoding even for tensors of one block; memory stays a few blocks (plus what the
    consumer keeps).

    ``reuse``: the buffers of an item are overwritten once the consumer asks for the next
    item, so the consumer must be done with their bytes by then (a sink's ``write_copy``
    copies and hashes before it returns); a consumer that keeps references (a sink that
    uploads later) must not ask for it.
    """
    # (item, bytes, itemsize): a block's values to encode, or (itemsize -1) a span header as is
    jobs: list[tuple[int, memoryview, int]] = []
    for i, (values, itemsize) in enumerate(items):
        mv = memoryview(values).cast("B")
        n = len(mv)
        if n == 0 or n % itemsize:
            raise ValueError(f"{n} value bytes cannot be split into {itemsize}-byte elements")
        r = block - block % itemsize
        _check_block_size(itemsize, r)
        jobs.append((i, memoryview(span_header(itemsize, r)), -1))
        jobs.extend((i, mv[lo : lo + r], itemsize) for lo in range(0, n, r))
    buffers = _buffers_for(block) if reuse else None
    if pool is None:
        for i, mv, e in jobs:
            if e < 0:
                yield i, [mv]
                continue
            pieces, owned = _encode_block(mv, e, buffers)
            yield i, pieces
            if owned is not None and buffers is not None:
                buffers.give(owned)
        return
    window = 2 * max(1, getattr(pool, "_max_workers", 2)) + 1
    pending: list[tuple[int, Future[tuple[list[Any], np.ndarray | None]] | list[Any]]] = []
    todo = iter(jobs)

    def submit() -> None:
        job = next(todo, None)
        if job is not None:
            i, mv, e = job
            pending.append((i, [mv] if e < 0 else pool.submit(_encode_block, mv, e, buffers)))

    try:
        for _ in range(window):
            submit()
        while pending:
            i, out = pending.pop(0)
            if isinstance(out, list):
                pieces, owned = out, None
            else:
                pieces, owned = out.result()
            submit()
            yield i, pieces
            del pieces
            if owned is not None and buffers is not None:
                buffers.give(owned)  # the consumer asked for the next item: done with it
    finally:
        for _, f in pending:
            if isinstance(f, Future):
                f.cancel()
        for _, f in pending:
            if isinstance(f, Future) and not f.cancelled():
                f.exception()  # wait: the memory they read must outlive them


_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}
_pool_lock = threading.Lock()


def _thread_nice() -> int:
    """The calling thread's nice value (Linux applies nice per thread; 0 elsewhere)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return 0


def shared_pool(threads: int) -> ThreadPoolExecutor:
    """The process's codec threads (encoding and decoding blocks), kept between calls:
    their per-thread scratch (the split's shifted copy, the planes to compress, the zstd
    contexts) stays warm, where a pool per save paid a page fault per 4 KiB of it again
    every time (a 96 MiB save spent ~20 ms on that).

    One pool per nice value of the calling thread: new threads inherit their creator's
    nice, and an async save's worker runs at a lower priority than training
    (``save_thread_nice``) which its encoding must keep, while a save or load on the
    training thread must not be demoted by a pool an async save created."""
    key = (max(1, threads), _thread_nice())
    with _pool_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = ThreadPoolExecutor(key[0], thread_name_prefix="ckpt-bpz")
        return pool


def _forget_pool() -> None:
    global _pools, _pool_lock, _shared, _shared_lock
    _pools, _pool_lock = {}, threading.Lock()  # a forked child has none of the parent's threads
    # nor their locks: one held by an encoder thread at the fork would stay held for ever
    _shared, _shared_lock = {}, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def encode(values: memoryview | bytes, itemsize: int, *, block: int = 4 << 20) -> bytes:
    return b"".join(bytes(b) for pieces in encode_blocks(values, itemsize, block=block) for b in pieces)


# --- decoding ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Where:
    path: str | None
    offset: int  # the span's offset in its file
    key: str | None

    def error(self, msg: str, at: int, cls: type[FormatError] = FormatError) -> FormatError:
        return cls(f"BPZ1 span: {msg}", path=self.path, offset=self.offset + at, key=self.key)


class SpanDecoder:
    """Decode one span fed in order, in pieces of any size, into ``dst`` (the values).

    Every declared length is checked before it is used (spec §V.3.3): the header, each
    block header against the block's raw length, each zstd frame's declared content size
    against its plane length before decompressing; frames decompress into a buffer of
    exactly the plane's length. Blocks that lie whole inside a fed piece are decoded from
    it in place; only a block split across pieces is gathered (at most one block's
    stored bytes). Memory: that block and one plane.

    With ``pool`` (and ``dst``), blocks are decoded on its threads, a few in flight, each
    from a copy of its stored bytes (the fed piece is the caller's, reused once ``feed``
    returns): every block header is still checked in order on the feeding thread before
    its job is queued; a block's decoding error surfaces at a later ``feed`` or at
    ``finish``. ``wait`` drains the jobs without raising (call it on every path that
    abandons the decoder, so no job writes ``dst`` after the caller moved on).
    """

    def __init__(
        self,
        dst: memoryview | None,
        itemsize: int,
        stored: int,
        *,
        path: str | None = None,
        offset: int = 0,
        key: str | None = None,
        nbytes: int | None = None,
        sink: Callable[[memoryview], None] | None = None,
        pool: ThreadPoolExecutor | None = None,
    ) -> None:
        """``dst``: where the values go. Or ``sink`` (with ``nbytes``): each decoded block's
        values are handed to it in order, from one reused block buffer (verification
        hashes values without holding them). Or neither (with ``nbytes``): every rule of
        §V.3.3 is checked and every zstd frame decompressed, but the planes are not
        merged into values (the merge cannot fail once the lengths are checked), so a
        span that passes decodes into any destination (verify, pass 1 of a load)."""
        if dst is None:
            if nbytes is None:
                raise ValueError("a SpanDecoder needs dst, or nbytes (with a sink, or to check only)")
            self._dst = memoryview(b"")
            self.nbytes = nbytes
        else:
            mv = memoryview(dst)
            self._dst = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
            self.nbytes = len(self._dst)
        self._sink = sink
        self.itemsize = itemsize
        self.stored = stored
        self._where = _Where(path, offset, key)
        if self.nbytes == 0 or self.nbytes % itemsize:
            raise self._where.error(f"{self.nbytes} value bytes do not split into {itemsize}-byte elements", 0)
        if stored < min_stored(self.nbytes):
            raise self._where.error(
                f"{stored} stored bytes cannot hold {self.nbytes} values (expansion above {MAX_EXPANSION})",
                0,
                LimitExceededError,
            )
        self._buf = bytearray()  # a unit split across fed pieces
        self._fed = 0
        self._pos = 0  # span bytes decoded (units consumed)
        self._block = 0  # R, once the header is read
        self._b = 0  # next block index
        self._pool = pool if sink is None else None
        self._jobs: deque[Future[None]] = deque()
        self._window = 2 * max(1, getattr(pool, "_max_workers", 2)) + 1

    @property
    def done(self) -> bool:
        return self._pos == self.stored and not self._buf

    def feed(self, data: memoryview | bytes) -> None:
        mv = memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        n = len(mv)
        if self._fed + n > self.stored:
            raise self._where.error(f"more than the span's {self.stored} bytes fed", self.stored)
        self._fed += n
        i = 0
        while True:
            if self._buf:
                want = self._want(memoryview(self._buf))
                if len(self._buf) < want:
                    take = min(want - len(self._buf), n - i)
                    if take == 0:
                        return
                    self._buf += mv[i : i + take]
                    i += take
                    continue  # a complete block header tells the block's whole length
                unit = bytes(self._buf)
                self._buf = bytearray()
                self._unit(memoryview(unit))
                continue
            if i == n:
                return
            rest = mv[i:]
            want = self._want(rest)
            if len(rest) < want:
                self._buf += rest
                return
            self._unit(rest[:want])
            i += want

    def _want(self, prefix: memoryview) -> int:
        """Length of the next unit (header or block), as far as ``prefix`` tells it."""
        e = self.itemsize
        if not self._block:
            return HEADER_SIZE
        lo = self._b * self._block
        if lo >= self.nbytes:
            raise self._where.error(f"bytes after the last block (at span byte {self._pos})", self._pos)
        if len(prefix) < 5 * e:
            return 5 * e
        plane_len = min(self._block, self.nbytes - lo) // e
        codecs = bytes(prefix[:e])
        lengths = struct.unpack_from(f"<{e}I", prefix, e)
        at = self._pos
        for p, (c, n) in enumerate(zip(codecs, lengths)):
            if c == _STORED:
                ok = n == plane_len
            elif c == _ZSTD:
                ok = 1 <= n < plane_len and plane_len <= MAX_EXPANSION * n
            else:
                raise self._where.error(f"block {self._b} plane {p}: reserved codec {c}", at + p)
            if not ok:
                raise self._where.error(
                    f"block {self._b} plane {p}: stored length {n} does not fit a {plane_len}-byte plane", at + e + 4 * p
                )
        total = 5 * e + sum(lengths)
        if self._pos + total > self.stored:
            raise self._where.error(f"block {self._b} ends at byte {self._pos + total}, past the span's {self.stored}", at)
        return total

    def _unit(self, unit: memoryview) -> None:
        w = self._where
        e = self.itemsize
        if not self._block:
            magic, planes, res1, block, res2 = _HEADER.unpack(unit)
            if magic != MAGIC:
                raise w.error(f"bad magic {magic!r}, expected {MAGIC!r}", 0)
            if planes != e:
                raise w.error(f"{planes} planes for a dtype of {e}-byte elements", 4)
            if res1 != b"\0\0\0" or res2 != b"\0\0\0\0":
                raise w.error("reserved header bytes are not zero", 5)
            if block % e or not (MIN_BLOCK <= block <= MAX_BLOCK):
                raise w.error(f"block size {block} out of range for {e}-byte elements", 8)
            self._block = block
            self._pos += HEADER_SIZE
            if self._sink is not None:
                self._dst = memoryview(bytearray(min(block, self.nbytes)))
            return
        lo = self._b * self._block
        raw_len = min(self._block, self.nbytes - lo)
        at = 0 if self._sink is not None else lo
        target: memoryview | int = self._dst[at : at + raw_len] if len(self._dst) else raw_len  # int: check only
        if self._pool is not None:
            if isinstance(target, int):
                # Checking reads only the zstd frames (the block header was checked in
                # _want): copy those, not the stored planes (most of a float block).
                job = self._pool.submit(self._check_frames, self._frames_only(unit), target, self._b, self._pos)
            else:
                data = unit if isinstance(unit.obj, bytes) else memoryview(bytes(unit))  # the caller reuses its piece
                job = self._pool.submit(self._decode_block, data, target, self._b, self._pos)
            self._jobs.append(job)
            while len(self._jobs) > self._window:
                self._jobs.popleft().result()
        else:
            self._decode_block(unit, target, self._b, self._pos)
            if self._sink is not None:
                self._sink(target)  # type: ignore[arg-type]  # a sink always has its block buffer
        self._pos += len(unit)
        self._b += 1

    def _frames_only(self, unit: memoryview) -> list[tuple[int, int, bytes]]:
        """The zstd frames of block ``unit`` as ``(plane, offset in the block, bytes)``,
        copied out of the caller's piece (checking reads nothing else)."""
        e = self.itemsize
        codecs = bytes(unit[:e])
        lengths = struct.unpack_from(f"<{e}I", unit, e)
        out = []
        pos = 5 * e
        for p, (c, n) in enumerate(zip(codecs, lengths)):
            if c == _ZSTD:
                out.append((p, pos, bytes(unit[pos : pos + n])))
            pos += n
        return out

    def _check_frames(self, frames: list[tuple[int, int, bytes]], raw_len: int, b: int, at: int) -> None:
        """Decompress (and drop) each zstd frame of block ``b`` (a check-only job)."""
        for p, pos, frame in frames:
            self._inflate(memoryview(frame), raw_len // self.itemsize, at + pos, b, p)

    def _decode_block(self, unit: memoryview, target: memoryview | int, b: int, at: int) -> None:
        """Block ``b`` (its stored bytes ``unit``, at span byte ``at``; header already
        checked by ``_want``) into ``target``, or (an int: its raw length) only checked.
        Runs on any thread."""
        e = self.itemsize
        plane_len = (target if isinstance(target, int) else len(target)) // e
        codecs = bytes(unit[:e])
        lengths = struct.unpack_from(f"<{e}I", unit, e)
        planes: list[Any] = []
        pos = 5 * e
        for p, (c, n) in enumerate(zip(codecs, lengths)):
            piece = unit[pos : pos + n]
            planes.append(piece if c == _STORED else self._inflate(piece, plane_len, at + pos, b, p))
            pos += n
        if not isinstance(target, int):
            _merge(planes, e, target)

    def _inflate(self, frame: memoryview, plane_len: int, at: int, b: int, p: int) -> bytes:
        w = self._where
        where = f"block {b} plane {p}"
        if bytes(frame[:4]) != _ZSTD_MAGIC:
            raise w.error(f"{where}: not a zstd frame", at)
        try:
            params = zstandard.get_frame_parameters(frame)
        except zstandard.ZstdError as e:
            raise w.error(f"{where}: malformed zstd frame header: {e}", at) from None
        # Checked before decompressing: the output buffer is the declared size, so a frame
        # claiming 1 GiB for a 1 MiB plane must never reach the decompressor.
        if params.content_size != plane_len:
            unknown = params.content_size == zstandard.CONTENTSIZE_UNKNOWN
            claimed = "no content size" if unknown else f"{params.content_size} bytes"
            raise w.error(f"{where}: zstd frame declares {claimed}, the plane has {plane_len}", at)
        if params.dict_id:
            raise w.error(f"{where}: zstd frame names dictionary {params.dict_id}", at)
        try:
            out = _thread_decompressor().decompress(frame, max_output_size=plane_len, allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise w.error(f"{where}: zstd data does not decode to its {plane_len}-byte plane: {e}", at) from None
        if len(out) != plane_len:
            raise w.error(f"{where}: zstd frame decodes to {len(out)} bytes, the plane has {plane_len}", at)
        return out

    def wait(self) -> None:
        """Let every queued block job end (errors dropped: ``finish`` reports them)."""
        while self._jobs:
            self._jobs.popleft().exception()

    def finish(self) -> None:
        try:
            while self._jobs:
                self._jobs[0].result()
                self._jobs.popleft()
        finally:
            self.wait()
        decoded = min(self._b * self._block, self.nbytes)
        if self._buf or self._pos != self.stored or decoded != self.nbytes:
            raise self._where.error(
                f"span ends after {self._pos} of {self.stored} stored bytes with {decoded} of {self.nbytes} values decoded",
                self._pos,
            )


def decode(span: bytes | memoryview, nbytes: int, itemsize: int, *, path: str | None = None, key: str | None = None) -> bytearray:
    """The values of a whole span in memory (tests, vectors); readers stream with SpanDecoder."""
    out = bytearray(nbytes)
    dec = SpanDecoder(memoryview(out), itemsize, len(span), path=path, key=key)
    dec.feed(span)
    dec.finish()
    return out
