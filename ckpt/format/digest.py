"""Per-chunk xxh3-128 digests, computed as bytes stream past (no second read pass)."""

from __future__ import annotations

import xxhash

__all__ = ["ChunkHasher", "DIGEST_SIZE", "chunk_count", "digest_bytes"]

DIGEST_SIZE = 16


def chunk_count(size: int, chunk_size: int) -> int:
    return (size + chunk_size - 1) // chunk_size


def digest_bytes(data: bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data)


class ChunkHasher:
    """Feed bytes in order; collects one 16-byte digest per ``chunk_size`` bytes.

    ``on_chunk(index, digest)`` lets a verifier compare each chunk as soon as it is
    complete, so corruption is reported at the first bad chunk.
    """

    __slots__ = ("chunk_size", "_h", "_fill", "digests", "size", "_on_chunk")

    def __init__(self, chunk_size: int, on_chunk=None) -> None:
        self.chunk_size = chunk_size
        self._h = xxhash.xxh3_128()
        self._fill = 0
        self.digests: list[bytes] = []
        self.size = 0
        self._on_chunk = on_chunk

    def update(self, data: bytes | memoryview) -> None:
        if type(data) is memoryview and data.format == "B" and data.ndim == 1:
            mv = data
        else:
            mv = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        pos, n = 0, len(mv)
        cs = self.chunk_size
        if 0 < n < cs - self._fill:
            # A piece inside the current chunk (many small tensors): one call, no loop.
            self._h.update(mv)
            self._fill += n
            self.size += n
            return
        while pos < n:
            take = min(cs - self._fill, n - pos)
            if take == cs and self._fill == 0:
                # whole chunk in one call: the one-shot digest avoids hasher state churn
                self._emit(xxhash.xxh3_128_digest(mv[pos : pos + cs]))
            else:
                self._h.update(mv[pos : pos + take])
                self._fill += take
                if self._fill == cs:
                    self._emit(self._h.digest())
                    self._h.reset()
                    self._fill = 0
            pos += take
        self.size += n

    def _emit(self, digest: bytes) -> None:
        idx = len(self.digests)
        self.digests.append(digest)
        if self._on_chunk is not None:
            self._on_chunk(idx, digest)

    def finish(self) -> bytes:
        """Close the last partial chunk; returns all digests concatenated."""
        if self._fill:
            self._emit(self._h.digest())
            self._h.reset()
            self._fill = 0
        return b"".join(self.digests)
