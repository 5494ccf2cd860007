"""Append-only tape writer with a fixed buffer and explicit durability knobs.

Memory is bounded whatever the run's length: records are framed straight into one
preallocated ``bytearray`` (``buffer_bytes``) that is written out when full, on
:meth:`flush`, and on :meth:`sync`. In zstd mode that same buffer is the block that
gets compressed. Pending index entries are bounded by the buffer too.

Durability (spec §7): data reaches the OS on every flush (the recorder flushes at
each step end, so a *process* crash loses at most the current step); it reaches the
disk on ``fsync_every`` records, every ``fsync_interval`` seconds, at every
checkpoint marker (the recorder calls :meth:`sync`), at segment rollover and at
close. A crash between syncs leaves a torn tail, which readers drop by rule.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import struct
import time
from pathlib import Path
from typing import Any

import xxhash

from replay.errors import ReplayError, TapeLimitError
from replay.tape import format as fmt
from replay.tape.index import IndexEntry, create_exclusive, encode_entry, encode_index_header

__all__ = ["TapeWriter", "segment_name", "index_path", "create_replacing"]

_DEFAULT_BUFFER = 1 << 20
_pack_tail = struct.Struct("<IHHQQQ").pack_into  # record header bytes 8..40 (format.py §5.1)
_pack_u64 = struct.Struct("<Q").pack_into
_xxh64 = xxhash.xxh3_64_intdigest


def segment_name(n: int) -> str:
    return f"{n:08d}.seg"


def index_path(path: Path, is_dir: bool) -> Path:
    return path / "index" if is_dir else path.with_name(path.name + ".idx")


def create_replacing(path: Path, head: bytes) -> int:
    """Create a fresh file holding ``head`` and rename it onto ``path``; return its open fd.

    The file is created exclusively under a random name in ``path``'s own directory, so
    a symlink planted at ``path`` (or at a predictable temporary name) is replaced as a
    link, never followed: nothing outside the tape is opened for writing."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = create_exclusive(tmp)
    try:
        os.write(fd, head)
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TapeWriter:
    """Writes one tape: a single file, or a directory of segments when ``segment_bytes`` is set.

    Never overwrites: the file (or directory) must not exist yet.
    """

    def __init__(self, path: str | os.PathLike[str], meta: dict[str, Any], *, run_id: bytes | None = None,
                 segment_bytes: int | None = None, chain: bool = False, zstd: bool = False, zstd_level: int = 3,
                 buffer_bytes: int = _DEFAULT_BUFFER, fsync_every: int | None = None,
                 fsync_interval: float | None = None, index: bool = True) -> None:
        self.path = Path(path)
        self.is_dir = segment_bytes is not None
        self.meta = dict(meta)
        self.run_id = run_id if run_id is not None else secrets.token_bytes(16)
        self.actors: list[str] = []  # kept current by the recorder; copied into each segment header
        self._segment_bytes = segment_bytes or 0
        self._flags = (fmt.FLAG_CHAIN if chain else 0) | (fmt.FLAG_ZSTD if zstd else 0)
        self._chain = chain
        self._zstd = zstd
        self._zstd_level = zstd_level
        cap = max(4096, buffer_bytes)
        if zstd:
            cap = min(cap, fmt.MAX_BLOCK_RAW - 4096)  # a block's compressed body must stay a valid record
        self._cap = cap
        self._buf = bytearray(cap)
        self._mv = memoryview(self._buf)
        self._pos = 0
        self._count = 0  # records in the buffer (the block's count in zstd mode)
        self._first_seq_in_buf = 0
        self._seq = 0
        self._last = 0  # last record's checksum (the hash chain's link)
        self._fsync_every = fsync_every or 0
        self._fsync_interval = fsync_interval or 0.0
        self._unsynced = 0
        self._last_sync = time.monotonic()
        self._segment = -1
        self._fd = -1
        self._seg_written = 0
        self._salt = 0
        self._closed = False
        self._max_step: int | None = None
        self._pending_index: list[tuple[int, int, int]] = []  # (step, seq, offset-or--1)
        self._index_fd = -1
        if self.is_dir:
            os.mkdir(self.path)  # FileExistsError if it exists: never mix two runs in one directory
        # The tape itself is created first (exclusively): the name is ours before the
        # sidecar next to it is touched.
        self._open_segment()
        if index:
            self._index_fd = create_replacing(index_path(self.path, self.is_dir), encode_index_header(self.run_id))

    # -- properties ------------------------------------------------------------------
    @property
    def seq(self) -> int:
        """The sequence number the next record will get."""
        return self._seq

    @property
    def closed(self) -> bool:
        return self._closed

    # -- segments --------------------------------------------------------------------
    def _open_segment(self) -> None:
        self._segment += 1
        self._salt = int.from_bytes(secrets.token_bytes(8), "little")
        meta = dict(self.meta)
        meta["actors"] = list(self.actors)
        header = fmt.encode_segment_header(run_id=self.run_id, salt=self._salt, segment=self._segment,
                                           first_seq=self._seq, chain_prev=self._last if self._chain else 0,
                                           flags=self._flags, meta=meta)
        target = self.path / segment_name(self._segment) if self.is_dir else self.path
        self._fd = create_exclusive(target)
        os.write(self._fd, header)
        # The header is made durable before any record can follow it, so a crash never
        # leaves records behind a header that might not exist.
        os.fsync(self._fd)
        _fsync_dir(self.path if self.is_dir else self.path.parent.resolve())
        self._seg_written = len(header)

    def _roll_if_due(self) -> None:
        if self.is_dir and self._seg_written >= self._segment_bytes:
            os.fsync(self._fd)
            os.close(self._fd)
            self._open_segment()

    # -- appending -------------------------------------------------------------------
    def note_step(self, step: int) -> None:
        """Tell the index a record with ``step`` comes next (cheap; only new maxima are kept)."""
        if self._max_step is None or step > self._max_step:
            self._max_step = step
            if self._index_fd >= 0:
                # The next record lands at buffer position self._pos unless its append
                # drains the buffer first; _resolve_index handles both cases.
                self._pending_index.append((step, self._seq, self._pos))

    def append(self, kind: int, body: bytes | bytearray | memoryview) -> int:
        """Frame one record into the buffer; returns its sequence number."""
        n = len(body)
        pos = self._pos
        if pos + 40 + n > self._cap:
            if self._closed:
                raise ReplayError("tape writer is closed", path=str(self.path))
            if n > fmt.MAX_RECORD:
                raise TapeLimitError(f"record body of {n} bytes above limit {fmt.MAX_RECORD}", path=str(self.path),
                                     seq=self._seq)
            self._drain()
            pos = 0
            if 40 + n > self._cap:
                return self._append_direct(kind, body)
        seq = self._seq
        if self._count == 0:
            self._first_seq_in_buf = seq
        # Inlined fmt.pack_record_into: this is the hot path (one call per event).
        end = pos + 40 + n
        buf = self._buf
        salt = self._salt
        _pack_tail(buf, pos + 8, n, kind, 0, seq, salt, self._last if self._chain else 0)
        buf[pos + 40 : end] = body
        c = _xxh64(self._mv[pos + 8 : end], salt)
        _pack_u64(buf, pos, c)
        self._last = c
        self._pos = end
        self._count += 1
        self._seq = seq + 1
        if self._fsync_every or self._fsync_interval:
            self._unsynced += 1
            if (self._fsync_every and self._unsynced >= self._fsync_every) or (
                    self._fsync_interval and time.monotonic() - self._last_sync >= self._fsync_interval):
                self.sync()
        return seq

    def _append_direct(self, kind: int, body: bytes | bytearray | memoryview) -> int:
        # A record larger than the buffer is written as its own (uncompressed) frame.
        seq = self._seq
        raw, c = fmt.encode_record(seq, kind, bytes(body), self._salt, self._last if self._chain else 0)
        self._resolve_index(self._seg_written, direct_seq=seq)
        os.write(self._fd, raw)
        self._seg_written += len(raw)
        self._last = c
        self._seq = seq + 1
        self._roll_if_due()
        return seq

    def _resolve_index(self, base: int, direct_seq: int = -1) -> None:
        """Write index entries for records about to be written at segment offset ``base``."""
        if not self._pending_index:
            return
        done: list[bytes] = []
        keep: list[tuple[int, int, int]] = []
        for step, q, bpos in self._pending_index:
            if q == direct_seq:
                done.append(encode_entry(IndexEntry(step, q, self._segment, base), self.run_id))
            elif q < self._seq:  # in the buffer being written
                off = base if self._zstd else base + bpos
                done.append(encode_entry(IndexEntry(step, q, self._segment, off), self.run_id))
            else:  # noted, not appended yet: it will start the emptied buffer
                keep.append((step, q, 0))
        self._pending_index = keep
        if done:
            os.write(self._index_fd, b"".join(done))

    def _drain(self) -> None:
        """Write the buffer out (as one zstd block in zstd mode)."""
        if self._pos == 0:
            if self._pending_index:
                self._resolve_index(self._seg_written)
            return
        if self._zstd:
            body = fmt.encode_block(self._mv[: self._pos], self._count, self._zstd_level)
            frame, _ = fmt.encode_record(self._first_seq_in_buf, fmt.BLOCK_KIND, body, self._salt, 0)
            data: bytes | memoryview = frame
        else:
            data = self._mv[: self._pos]
        self._resolve_index(self._seg_written)
        written = 0
        while written < len(data):
            written += os.write(self._fd, data[written:])
        self._seg_written += len(data)
        self._pos = 0
        self._count = 0
        self._roll_if_due()

    def flush(self) -> None:
        """Hand buffered records to the OS (survives a process crash, not a power cut)."""
        if not self._closed:
            self._drain()

    def sync(self) -> None:
        """Flush and fsync: everything appended so far survives a power cut."""
        if self._closed:
            return
        self._drain()
        os.fsync(self._fd)
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def close(self) -> None:
        """Write everything, end the tape with its close record (§5.5) and fsync it.

        A tape without a close record was cut short (crash, kill, lost last segment);
        ``ckpt tape verify`` tells it apart from a cleanly closed one."""
        if self._closed:
            return
        try:
            self._drain()
            if self._index_fd >= 0:
                os.fsync(self._index_fd)  # a closed tape's index is complete (§10 validation)
            # Plain, after the last block, never compressed: a reader finds it at the end.
            raw, _ = fmt.encode_record(self._seq, fmt.CLOSE_KIND, b"", self._salt, self._last if self._chain else 0)
            os.write(self._fd, raw)
            self._seg_written += len(raw)
            os.fsync(self._fd)
        finally:
            self._closed = True
            self._cap = 0  # every later append takes the slow path, which refuses
            os.close(self._fd)
            if self._index_fd >= 0:
                os.close(self._index_fd)

    def abandon(self) -> None:
        """Hand buffered records to the OS and release the files *without* a close record:
        exactly what a killed process leaves (an injected crash uses it; so do tests)."""
        if self._closed:
            return
        try:
            self._drain()
        finally:
            self._closed = True
            self._cap = 0
            os.close(self._fd)
            if self._index_fd >= 0:
                os.close(self._index_fd)

    def __enter__(self) -> "TapeWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
