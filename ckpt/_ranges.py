"""The one verified-range walker: every read of a data file's tensor bytes goes through it.

It walks a byte range of one file in bounded pieces, hashes every chunk the range
overlaps against the MANIFEST's digests, and delivers the pieces to their targets: a
plain tensor's bytes are copied into its destination, a packed (BPZ1) span is decoded
into its destination, and a target without a destination is *checked* the same way with
nothing kept (a span is decoded rule by rule, every zstd frame decompressed; a recorded
tensor digest is compared with the values).

``verify``, pass 1 and pass 2 of the in-place load, lazy ``tensor()`` reads and the
streaming fresh load all call it, so what verify accepts is what a load decodes, by
construction (spec §11 "Verify", format-2.md §V.6): a checkpoint that verifies does not
fail to load on its own content, and a load's pass 1 finds every content defect before
pass 2 writes a target.

:func:`read_tiled` is the one other strategy: a whole safetensors file read straight
into its destinations and hashed there (no scratch copy), which the tiling of the data
region makes a full verification of the file.
"""

from __future__ import annotations

import ctypes
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from ._helpers import share
from ._pipeline import OrderedFeeder
from .errors import ChecksumMismatchError, FormatError, SizeMismatchError
from .format.digest import DIGEST_SIZE, ChunkHasher
from .format.manifest import FileEntry, TensorEntry

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from .storage import ReadHandle

__all__ = [
    "Target", "RangeWalker", "ChunkVerifier", "read_tiled", "verify_view", "MappedFile", "PIECE",
    "PIPELINE_MIN_BYTES", "SHARED_PIECE",
]

#: ranges at least this long are hashed on a second thread while the next piece is read
PIPELINE_MIN_BYTES = 32 << 20
#: the most a walk holds beside its destinations (verify, lazy reads, pass 1)
PIECE = 8 << 20
#: bytes per piece two threads take in turn hashing a mapping, or copying out of one: a
#: thread left waiting at the end holds the other up for at most one piece
SHARED_PIECE = 4 << 20

#: ``read(offset, buffer) -> bytes read``: a held handle's ``pread_into`` or the storage's
ReadAt = Callable[[int, memoryview], int]


class ChunkVerifier:
    """Compares each chunk's digest as soon as the chunk is complete."""

    def __init__(self, path: str, entry: FileEntry, *, first: int = 0, key: str | None = None) -> None:
        """``first``: the chunk the fed bytes start at (a range, not the whole file)."""
        self.path = path
        self.entry = entry
        self.first = first
        self.key = key
        self.hasher = ChunkHasher(entry.chunk_size, self._check)

    def _check(self, idx: int, digest: bytes) -> None:
        idx += self.first
        want = self.entry.digests[idx * DIGEST_SIZE : (idx + 1) * DIGEST_SIZE]
        if digest != want:
            cs = self.entry.chunk_size
            lo, hi = idx * cs, min((idx + 1) * cs, self.entry.size)
            raise ChecksumMismatchError(
                f"chunk {idx} (bytes {lo}..{hi}) does not match its digest",
                path=self.path,
                offset=lo,
                key=self.key,
                chunk=idx,
                byte_range=(lo, hi),
            )

    def update(self, data: Any) -> None:
        self.hasher.update(data)

    def finish(self) -> None:
        self.hasher.finish()


class _PipelinedVerifier:
    """A ChunkVerifier fed from one background thread, in submission order: the first
    mismatch is raised by the next ``update`` or by ``finish``."""

    def __init__(self, inner: ChunkVerifier) -> None:
        self._inner = inner
        self._feeder = OrderedFeeder(inner.update, "ckpt-verify")

    def update(self, data: Any) -> None:
        self._feeder.feed(data)

    def finish(self) -> None:
        self._feeder.finish()
        self._inner.finish()

    def abort(self) -> None:
        self._feeder.abort()


@dataclass(slots=True)
class Target:
    """One tensor of the walked file: its values go to ``dst``, or (``dst`` None) they
    are checked as a read into any destination would check them, and dropped."""

    entry: TensorEntry
    dst: memoryview | None = None


def _bytes_view(mv: memoryview) -> memoryview:
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _values_digest_error(path: str, t: TensorEntry) -> ChecksumMismatchError:
    return ChecksumMismatchError(
        "tensor values do not match the digest the manifest records", path=path, offset=t.offset, key=t.key
    )


def _check_values(path: str, t: TensorEntry, mv: memoryview) -> None:
    import xxhash

    if xxhash.xxh3_128_digest(mv[t.offset : t.offset + t.nbytes]) != t.digest:
        raise _values_digest_error(path, t)


def _check_chunks(path: str, f: FileEntry, mv: memoryview, first: int, stop: int) -> None:
    cs = f.chunk_size
    piece = mv[first * cs : stop * cs]
    try:
        v = ChunkVerifier(path, f, first=first)
        v.update(piece)
        v.finish()
    finally:
        # A mismatch's traceback keeps the hashing frames, and so this slice: released,
        # it no longer holds the mapping open (the load unmaps it when it raises).
        piece.release()


def verify_view(
    path: str, f: FileEntry, mv: memoryview, entries: Sequence[TensorEntry] = (), *, parallel_min: int | None = None
) -> None:
    """Check every chunk of ``mv`` (the whole file ``f``, mapped or in memory, nothing
    copied), then the recorded digests (format 2.0) of the plain tensors among ``entries``:
    the checks every walk makes as it reads.

    From ``parallel_min`` bytes on (default :data:`PIPELINE_MIN_BYTES`), on this thread and
    a helper at once (xxh3 releases the GIL, and a mapping's first touch of each page is
    paid on both cores), each taking the next piece of about :data:`SHARED_PIECE` bytes as
    it finishes one (``_helpers.share``): a helper the scheduler keeps waiting holds the
    check up for the piece it runs at most. The error raised is the one the checks made in
    order raise first."""
    cs = f.chunk_size
    nchunks = (f.size + cs - 1) // cs
    per = max(1, SHARED_PIECE // cs)  # whole chunks: a chunk's digest is one sequential hash
    jobs: list[Callable[[], None]] = [
        partial(_check_chunks, path, f, mv, a, min(a + per, nchunks)) for a in range(0, nchunks, per)
    ]
    jobs += [partial(_check_values, path, t, mv) for t in entries if t.digest is not None and t.encoding is None]
    if f.size < (PIPELINE_MIN_BYTES if parallel_min is None else parallel_min):
        for job in jobs:
            job()
        return
    share(jobs)


class MappedFile:
    """A whole file held in a mapping (a leased one, ``ckpt.storage._lease``), read like a
    handle: ``pread_into`` copies out of it with ``memmove``, which releases the GIL, so
    the reads ``read_tiled`` splits between two threads copy at once. ``view`` is the
    mapping itself, for hashing it in place (:func:`verify_view`). The caller keeps the
    mapping open while this is used."""

    __slots__ = ("path", "view", "_addr", "_size")
    mappable = False

    def __init__(self, path: str, mapping: Any, size: int) -> None:
        self.path = path
        self.view = memoryview(mapping)[:size]
        probe = ctypes.c_char.from_buffer(mapping)
        self._addr = ctypes.addressof(probe)
        del probe  # an exported buffer would keep the mapping from closing
        self._size = size

    def pread_into(self, offset: int, buf: memoryview) -> int:
        n = max(0, min(len(buf), self._size - offset))
        if n:
            dst = ctypes.c_char.from_buffer(_bytes_view(buf))
            ctypes.memmove(ctypes.addressof(dst), self._addr + offset, n)
            del dst
        return n

    def size(self) -> int:
        return self._size

    def map_private(self, size: int, *, require_lease: bool = True) -> None:
        return None  # it is a mapping already: never mapped twice

    def close(self) -> None:
        self.view.release()


class _Delivery:
    """A target being fed: plain bytes copied (and hashed for its digest), or a span decoded."""

    def __init__(self, walker: "RangeWalker", target: Target) -> None:
        t = target.entry
        self.entry = t
        self.dst = _bytes_view(target.dst) if target.dst is not None else None
        self.path = walker.path
        # A recorded digest (format 2.0) is checked wherever chunks are: load refuses
        # what verify refuses, never returns values the manifest disowns.
        self.hasher: Any = None
        if walker.verify and t.digest is not None:
            import xxhash

            self.hasher = xxhash.xxh3_128()
        self.decoder: Any = None
        if t.encoding is not None:
            from .format import bpz, dtypes  # numpy: only when a packed tensor is read (inspect stays light)

            sink = self.hasher.update if self.dst is None and self.hasher is not None else None
            self.decoder = bpz.SpanDecoder(
                self.dst, dtypes.itemsize(t.dtype), t.stored_nbytes, path=self.path, offset=t.offset, key=t.key,
                nbytes=t.nbytes, sink=sink, pool=walker.pool,
            )
            walker.decoders.append(self.decoder)

    def feed(self, piece: memoryview, at: int) -> None:
        """``piece``: the target's stored bytes from byte ``at`` of its extent on."""
        if self.decoder is not None:
            self.decoder.feed(piece)
            return
        if self.dst is not None:
            self.dst[at : at + len(piece)] = piece
        if self.hasher is not None:
            self.hasher.update(piece)

    def finish(self) -> None:
        if self.decoder is not None:
            self.decoder.finish()
            if self.hasher is not None and self.dst is not None:
                self.hasher.update(self.dst)  # the decoded values, now all in place
        if self.hasher is not None and self.hasher.digest() != self.entry.digest:
            raise _values_digest_error(self.path, self.entry)


class _Run:
    """One contiguous range of the file and the targets inside it, fed piece by piece."""

    def __init__(self, walker: "RangeWalker", lo: int, hi: int, group: list[Target]) -> None:
        self.w = walker
        self.lo, self.hi = lo, hi
        self.stop = hi  # lowered when a span fails to decode: hash on to the end of its chunk only
        self.group = group
        self.next = 0
        self.cur: _Delivery | None = None
        self.failed: FormatError | None = None
        f = walker.file
        key = group[0].entry.key if len(group) == 1 else None
        self.verifier = ChunkVerifier(walker.path, f, first=lo // f.chunk_size, key=key) if walker.verify else None

    def consume(self, at: int, piece: memoryview, *, last: bool = False) -> None:
        """Hash ``piece`` (at file byte ``at``), then deliver it. ``last``: the run's one
        piece: its chunks are all checked before any destination is written."""
        if at + len(piece) > self.stop:
            # Read ahead (on the pipelined path) past the chunk a span failed in: only the
            # chunks up to there are hashed, so the error reported is that chunk's or the span's.
            if at >= self.stop:
                return
            piece = piece[: self.stop - at]
        if self.verifier is not None:
            self.verifier.update(piece)  # a corrupt chunk is named before its bytes are decoded
            if last:
                self.verifier.finish()
                self.verifier = None
        if self.failed is not None:
            return
        try:
            self._deliver(at, piece)
        except FormatError as e:
            # Hash on to the end of this chunk first: if its bytes are damaged, that is
            # the error to report, not what the decoder made of them.
            self.failed = e
            if self.verifier is None:
                raise
            cs = self.w.file.chunk_size
            self.stop = min(self.stop, ((at + len(piece) - 1) // cs + 1) * cs)

    def _deliver(self, at: int, piece: memoryview) -> None:
        end = at + len(piece)
        while True:
            if self.cur is None:
                if self.next >= len(self.group) or self.group[self.next].entry.offset >= end:
                    return
                self.cur = _Delivery(self.w, self.group[self.next])
                self.next += 1
            t = self.cur.entry
            lo, hi = t.offset, t.offset + t.stored_nbytes
            a, b = max(lo, at), min(hi, end)
            if a < b:
                self.cur.feed(piece[a - at : b - at], a - lo)
            if hi > end:
                return
            cur, self.cur = self.cur, None
            cur.finish()

    def finish(self) -> None:
        if self.verifier is not None:
            self.verifier.finish()
        if self.failed is not None:
            raise self.failed
        if self.cur is not None or self.next < len(self.group):
            t = (self.cur.entry if self.cur is not None else self.group[self.next].entry)
            raise SizeMismatchError("file ended before the tensors its manifest lists", path=self.w.path, key=t.key)


class RangeWalker:
    """Walks ranges of one data file: hash, decode, deliver (see the module docstring).

    ``verify``: hash every chunk a range overlaps, and compare recorded tensor digests;
    without it, only the targets' own bytes are read, and packed spans are still decoded
    under every rule (a load never writes what it could not decode). ``pool``: packed
    spans with a destination, or checked without a digest, decode their blocks on these
    threads while the next piece is read.
    """

    def __init__(
        self, path: str, f: FileEntry, read: ReadAt, *, verify: bool, pool: "ThreadPoolExecutor | None" = None
    ) -> None:
        self.path = path
        self.file = f
        self.read = read
        self.verify = verify
        self.pool = pool
        self.decoders: list[Any] = []

    def walk(
        self, targets: Sequence[Target], *, whole: bool = False, progress: Callable[[int], None] | None = None
    ) -> int:
        """Deliver every target; returns the bytes read. ``whole``: the entire file, every
        chunk hashed (verify), not only the chunks the targets overlap."""
        ordered = sorted(targets, key=lambda x: x.entry.offset)
        # An empty plain tensor has no bytes to read; its digest is still the manifest's.
        for tg in ordered:
            if tg.entry.encoding is None and not tg.entry.nbytes:
                _Delivery(self, tg).finish()
        ordered = [tg for tg in ordered if tg.entry.encoding is not None or tg.entry.nbytes]
        total = 0
        try:
            for lo, hi, group in self._runs(ordered, whole):
                total += self._walk_run(_Run(self, lo, hi, group), progress)
        finally:
            for dec in self.decoders:
                dec.wait()  # no block job writes a destination after this returns or raises
            self.decoders.clear()
        return total

    def _runs(self, ordered: list[Target], whole: bool) -> list[tuple[int, int, list[Target]]]:
        """Ranges to read: with ``verify`` each target widened to whole chunks; targets
        whose ranges touch are read as one run, so every chunk is read and hashed once."""
        f = self.file
        if whole:
            return [(0, f.size, ordered)] if f.size else []
        cs = f.chunk_size
        runs: list[tuple[int, int, list[Target]]] = []
        for tg in ordered:
            t = tg.entry
            lo, hi = t.offset, t.offset + t.stored_nbytes
            if self.verify:
                lo, hi = (lo // cs) * cs, min(((hi - 1) // cs + 1) * cs, f.size)
            if runs and lo <= runs[-1][1]:
                runs[-1] = (runs[-1][0], max(runs[-1][1], hi), runs[-1][2] + [tg])
            else:
                runs.append((lo, hi, [tg]))
        return runs

    def _read_exact(self, pos: int, buf: memoryview, key: str | None) -> None:
        got = self.read(pos, buf)
        if got != len(buf):
            what = "file ended inside a tensor" if key is not None else "file shorter than its manifest size"
            raise SizeMismatchError(what, path=self.path, offset=pos + got, key=key)

    def _walk_run(self, run: _Run, progress: Callable[[int], None] | None) -> int:
        lo, hi = run.lo, run.hi
        key = run.group[0].entry.key if len(run.group) == 1 else None
        only = run.group[0] if len(run.group) == 1 else None
        if not self.verify and only is not None and only.entry.encoding is None and only.dst is not None:
            # Nothing to hash or decode: straight into the destination, no scratch.
            self._read_exact(lo, _bytes_view(only.dst), key)
            if progress is not None:
                progress(hi - lo)
            run.next = 1
            return hi - lo
        if self.verify and hi - lo >= PIPELINE_MIN_BYTES:
            return self._pipelined(run, progress, key)
        # The buffer follows the bytes read, never the declared chunk size: a MANIFEST
        # may declare 1 GiB chunks for a 4 KiB file (§12).
        buf = memoryview(bytearray(min(hi - lo, PIECE)))
        pos = lo
        while pos < run.stop:
            n = min(len(buf), run.stop - pos)
            piece = buf[:n]
            self._read_exact(pos, piece, key)
            run.consume(pos, piece, last=n == hi - lo)
            pos += n
            if progress is not None:
                progress(n)
        run.finish()
        return pos - lo

    def _pipelined(self, run: _Run, progress: Callable[[int], None] | None, key: str | None) -> int:
        """Two half pieces: one is hashed and delivered on a second thread while the next
        is read (preadv, xxh3 and zstd release the GIL); memory stays one PIECE."""
        step = PIECE // 2
        free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        for _ in range(2):
            free.put(memoryview(bytearray(step)))
        failed: list[BaseException] = []

        def consume(item: tuple[memoryview, int, int]) -> None:
            buf, n, at = item
            try:
                if not failed:
                    run.consume(at, buf[:n])
            except BaseException as e:  # re-raised on the reading thread
                failed.append(e)
            finally:
                free.put(buf)  # always returned, or the reader would wait forever

        pos = run.lo
        feeder = OrderedFeeder(consume, "ckpt-verify")
        try:
            while pos < run.stop and not failed:
                want = min(step, run.stop - pos)
                mv = free.get()
                try:
                    self._read_exact(pos, mv[:want], key)
                except BaseException:
                    free.put(mv)
                    raise
                feeder.feed((mv, want, pos))
                pos += want
                if progress is not None:
                    progress(want)
        finally:
            feeder.finish()
        if failed:
            raise failed[0]
        run.finish()
        return pos - run.lo


def _read_piece(handle: "ReadHandle", fp: str, t: TensorEntry, piece: memoryview, lo: int) -> None:
    got = handle.pread_into(t.offset + lo, piece)
    if got != len(piece):
        raise SizeMismatchError("file ended inside a tensor", path=fp, offset=t.offset + lo + got, key=t.key)


def _parallel_reads(handle: "ReadHandle", fp: str, jobs: list[tuple[TensorEntry, memoryview]], request: int) -> None:
    """Read (tensor, destination) pairs in ``request``-sized pieces, in file order, on this
    thread and a helper taking the next piece in turn (``_helpers.share``)."""
    calls: list[Callable[[], None]] = []
    for t, dst in jobs:
        mv = _bytes_view(dst)
        for lo in range(0, t.nbytes, request):
            calls.append(partial(_read_piece, handle, fp, t, mv[lo : lo + request], lo))
    share(calls)


def read_tiled(
    fp: str,
    f: FileEntry,
    handle: "ReadHandle",
    header_len: int,
    entries: Sequence[TensorEntry],
    destinations: Callable[[TensorEntry], memoryview],
    *,
    verify: bool,
    request: int,
) -> None:
    """Every tensor of a safetensors file whose tensors tile its data region (one this
    checkpoint wrote), read in file order straight into the destinations: verification
    hashes the header and each destination right after its read, so a full load costs
    one read and one hash pass with no scratch copy, and covers every byte of the file."""
    verifier: ChunkVerifier | _PipelinedVerifier | None = None
    try:
        if verify:
            # Large files hash on a second thread while the next tensor is read.
            verifier = ChunkVerifier(fp, f)
            if f.size >= PIPELINE_MIN_BYTES:
                verifier = _PipelinedVerifier(verifier)
            head = bytearray(8 + header_len)
            got = handle.pread_into(0, memoryview(head))
            if got != len(head):
                raise SizeMismatchError("file shorter than its manifest size", path=fp, offset=got)
            verifier.update(head)
        ordered = sorted(entries, key=lambda e: e.offset)
        if verifier is None and f.size >= PIPELINE_MIN_BYTES:
            # Without hashing, the second core has nothing to do: split the reads
            # between two threads (the copy from the page cache is the cost). A copy out
            # of a mapping costs no system call: smaller pieces, a shorter wait at the end.
            if isinstance(handle, MappedFile):
                request = min(request, SHARED_PIECE)
            _parallel_reads(handle, fp, [(t, destinations(t)) for t in ordered], request)
            return
        digests: list[tuple[TensorEntry, memoryview]] = []
        for t in ordered:
            dst = destinations(t)
            got = handle.pread_into(t.offset, dst)
            if got != t.nbytes:
                raise SizeMismatchError("file ended inside a tensor", path=fp, offset=t.offset + got, key=t.key)
            if verifier is not None:
                verifier.update(dst)
                if t.digest is not None:
                    digests.append((t, dst))
        if verifier is not None:
            verifier.finish()
            verifier = None
            if digests:
                import xxhash

                for t, dst in digests:
                    if xxhash.xxh3_128_digest(_bytes_view(dst)) != t.digest:
                        raise _values_digest_error(fp, t)
    finally:
        if isinstance(verifier, _PipelinedVerifier):
            verifier.abort()
