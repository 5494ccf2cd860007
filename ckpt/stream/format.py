"""The checkpoint stream (spec/checkpoint-stream.md): one committed checkpoint as one
verified byte sequence. Pure framing over two callables, ``write(bytes)`` and
``read(n) -> bytes``; the files are read and written here, nothing else is touched.

Every frame carries the xxh3-128 of its bytes and is checked before it is written, so a
flipped bit on the wire is caught on arrival and named (file, offset); the checkpoint's
own MANIFEST digests are checked again when the received directory is opened.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import msgpack
import xxhash

from ..errors import (CheckpointExistsError, ChecksumMismatchError, FormatError, LimitExceededError, SizeMismatchError,
                      UnsafePathError, UnsupportedVersionError)
from ..format.codec import ContainerLimitError, bounded
from ..format.manifest import MANIFEST_NAME, TMP_PREFIX, check_name

__all__ = ["MAGIC", "END_MAGIC", "VERSION", "MAX_HEADER", "MIN_CHUNK", "MAX_CHUNK", "DEFAULT_CHUNK", "DEFAULT_MAX_BYTES",
           "StreamInfo", "write_stream", "read_stream", "stream_files"]

MAGIC = b"CKSTREAM"
END_MAGIC = b"CKSTEND\0"
VERSION = 1
MAX_HEADER = 1 << 20
MIN_CHUNK = 4096
MAX_CHUNK = 64 << 20
DEFAULT_CHUNK = 1 << 20
"""Bytes per frame of a stream written with the defaults (1 MiB)."""
DEFAULT_MAX_BYTES = 64 << 30
"""The most bytes a reader accepts from one stream by default (64 GiB)."""
_PRE = struct.Struct("<8sHHI")
_FRAME = struct.Struct("<I16s")
_TRAILER = struct.Struct("<8sQ16s")

Write = Callable[[bytes], None]
Read = Callable[[int], bytes]
# (frame index, frame bytes): fault injection for tests; called after the digest is taken
Tamper = Callable[[int, bytearray], None]


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """What went over the wire: the stream digest (xxh3-128 of the frame digests), the data
    bytes, the files in order, and the header's informative ``meta``. ``path`` is the
    received checkpoint (receiver side only)."""

    digest: bytes
    nbytes: int
    files: tuple[tuple[str, int], ...]
    meta: Mapping[str, Any] = field(default_factory=dict)
    path: str | None = None
    wire_bytes: int = 0


def _local_only(path: str | os.PathLike[str]) -> str:
    """Streams read and write local checkpoint directories: a URL is refused (never a
    local folder named ``s3:``); an object store is written with ``ckpt.save(url)``."""
    from ..errors import UnsupportedSchemeError
    from ..storage import url_scheme

    p = os.fspath(path)
    scheme = url_scheme(p) if isinstance(p, str) else None
    if scheme is not None:
        raise UnsupportedSchemeError(f"checkpoint streams read and write local directories, not {scheme}:// URLs",
                                     path=p, scheme=scheme)
    return p


def stream_files(directory: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """The files of a committed checkpoint in stream order: part files by name, MANIFEST last."""
    d = _local_only(directory)
    names = sorted(os.listdir(d))
    if MANIFEST_NAME not in names:
        raise FormatError("not a committed checkpoint: no MANIFEST", path=d)
    out = []
    for n in [x for x in names if x != MANIFEST_NAME] + [MANIFEST_NAME]:
        if n != MANIFEST_NAME:
            check_name(n, what="checkpoint file", path=d)
        st = os.lstat(os.path.join(d, n))
        if not os.path.isfile(os.path.join(d, n)) or os.path.islink(os.path.join(d, n)):
            raise UnsafePathError("a checkpoint holds plain files only", path=os.path.join(d, n))
        out.append((n, st.st_size))
    return out


def write_stream(directory: str | os.PathLike[str], write: Write, *, chunk_bytes: int = DEFAULT_CHUNK,
                 meta: Mapping[str, Any] | None = None, tamper: Tamper | None = None) -> StreamInfo:
    """Stream the committed checkpoint at ``directory`` through ``write``."""
    if not MIN_CHUNK <= chunk_bytes <= MAX_CHUNK:
        raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK}, {MAX_CHUNK}], got {chunk_bytes}")
    d = os.fspath(directory)
    files = stream_files(d)
    header = msgpack.packb({"name": os.path.basename(os.path.normpath(d)), "chunk": chunk_bytes,
                            "files": [[n, s] for n, s in files], "meta": dict(meta or {})}, use_bin_type=True)
    if len(header) > MAX_HEADER:
        raise LimitExceededError(f"stream header of {len(header)} bytes above {MAX_HEADER}", path=d)
    pre = _PRE.pack(MAGIC, VERSION, 0, len(header)) + header
    write(pre + xxhash.xxh3_128_digest(pre))
    wire = len(pre) + 16
    digests = xxhash.xxh3_128()
    total = index = 0
    for name, size in files:
        with open(os.path.join(d, name), "rb") as f:
            left = size
            while left:
                data = f.read(min(chunk_bytes, left))
                if not data:
                    raise SizeMismatchError(f"{name} shrank while it was streamed", path=os.path.join(d, name))
                dg = xxhash.xxh3_128_digest(data)
                digests.update(dg)
                if tamper is not None:
                    buf = bytearray(data)
                    tamper(index, buf)
                    data = bytes(buf)
                write(_FRAME.pack(len(data), dg) + data)
                wire += _FRAME.size + len(data)
                left -= len(data)
                total += len(data)
                index += 1
    sd = digests.digest()
    write(_TRAILER.pack(END_MAGIC, total, sd))
    return StreamInfo(sd, total, tuple(files), dict(meta or {}), wire_bytes=wire + _TRAILER.size)


class _Reader:
    def __init__(self, read: Read) -> None:
        self._read = read
        self.offset = 0

    def exact(self, n: int, what: str) -> bytes:
        parts = []
        got = 0
        while got < n:
            b = self._read(n - got)
            if not b:
                raise SizeMismatchError(f"stream ended inside {what}: {got} of {n} bytes", offset=self.offset)
            parts.append(b)
            got += len(b)
        data = b"".join(parts)
        if len(data) != n:
            raise SizeMismatchError(f"read returned {len(data)} bytes for {what}, asked {n}", offset=self.offset)
        self.offset += n
        return data


def _header(r: _Reader, max_bytes: int) -> tuple[dict[str, Any], list[tuple[str, int]], int]:
    pre = r.exact(_PRE.size, "the preamble")
    magic, version, flags, hlen = _PRE.unpack(pre)
    if magic != MAGIC:
        raise FormatError(f"not a checkpoint stream (magic {magic!r})", offset=0)
    if version != VERSION:
        raise UnsupportedVersionError(f"checkpoint stream version {version}; this reader knows {VERSION}", offset=8)
    if flags != 0:
        raise FormatError(f"stream flags must be 0, got {flags:#x}", offset=10)
    if not 1 <= hlen <= MAX_HEADER:
        raise LimitExceededError(f"stream header length {hlen} outside [1, {MAX_HEADER}]", offset=12)
    raw = r.exact(hlen, "the header")
    want = r.exact(16, "the header digest")
    if xxhash.xxh3_128_digest(pre + raw) != want:
        raise ChecksumMismatchError("stream header digest mismatch", offset=16 + hlen)
    try:
        h = msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=_no_ext, **bounded(len(raw)))
    except ContainerLimitError as e:
        raise LimitExceededError(f"stream header: {e}", offset=16) from None
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as e:
        raise FormatError(f"stream header is not msgpack: {e}", offset=16) from None
    if not isinstance(h, dict) or set(h) != {"name", "chunk", "files", "meta"}:
        raise FormatError("stream header must be a map of name, chunk, files, meta", offset=16)
    chunk = h["chunk"]
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not MIN_CHUNK <= chunk <= MAX_CHUNK:
        raise FormatError(f"stream chunk size {chunk!r} outside [{MIN_CHUNK}, {MAX_CHUNK}]", offset=16)
    if not isinstance(h["files"], list) or not isinstance(h["meta"], dict) or not isinstance(h["name"], str):
        raise FormatError("stream header fields have the wrong types", offset=16)
    files: list[tuple[str, int]] = []
    seen: set[str] = set()
    total = 0
    for item in h["files"]:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], int) or isinstance(item[1], bool) or item[1] < 0):
            raise FormatError(f"bad file entry {item!r:.80} in the stream header", offset=16)
        name, size = item
        if name != MANIFEST_NAME:
            check_name(name, what="streamed file")
        if name in seen:
            raise UnsafePathError(f"file {name!r} listed twice in the stream", key=name)
        seen.add(name)
        total += size
        if total > max_bytes:
            raise LimitExceededError(f"the stream announces more than {max_bytes} bytes", offset=16, key=name)
        files.append((name, size))
    if not files or files[-1][0] != MANIFEST_NAME:
        raise FormatError("the stream must list the MANIFEST, last", offset=16)
    return h, files, chunk


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed in a stream header")


def read_stream(read: Read, dest: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES,
                unread: Callable[[], int] | None = None) -> StreamInfo:
    """Receive a stream into the new checkpoint directory ``dest`` (it must not exist).

    The receiver reads exactly up to the trailer and no further (spec §2: nothing follows
    it; on a live transport, reading on would wait for bytes that never come).
    ``unread()``, when given, says how many bytes the transport already holds past what
    ``read`` returned: any is refused (``FormatError``), since a sender that wrote after
    its trailer is not following the format.

    Each frame is checked before it is written; the files land in a temporary directory
    that is renamed to ``dest`` only after the trailer checked out, and ``dest`` is then
    opened as a committed checkpoint. On any error nothing is left behind."""
    from ..reader import CheckpointReader

    final = _local_only(dest)
    if os.path.lexists(final):
        raise CheckpointExistsError("the destination exists: a stream is received into a new directory", path=final)
    r = _Reader(read)
    h, files, chunk = _header(r, max_bytes)
    parent = os.path.dirname(os.path.abspath(final))
    tmp = tempfile.mkdtemp(prefix=TMP_PREFIX + "stream-", dir=parent)
    placed = False
    try:
        digests = xxhash.xxh3_128()
        total = 0
        for name, size in files:
            fd = os.open(os.path.join(tmp, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                pos = 0
                while pos < size:
                    at = r.offset
                    n, dg = _FRAME.unpack(r.exact(_FRAME.size, f"a frame head of {name}"))
                    want = min(chunk, size - pos)
                    if n != want:
                        raise FormatError(f"frame of {name} at byte {pos} holds {n} bytes, the layout says {want}",
                                          offset=at, key=name)
                    data = r.exact(n, f"a frame of {name}")
                    if xxhash.xxh3_128_digest(data) != dg:
                        raise ChecksumMismatchError(f"frame of {name} at byte {pos} arrived damaged (digest mismatch)",
                                                    offset=at, key=name)
                    digests.update(dg)
                    mv = memoryview(data)
                    while mv:
                        mv = mv[os.write(fd, mv):]
                    pos += n
                    total += n
            finally:
                os.close(fd)
        at = r.offset
        magic, t, sd = _TRAILER.unpack(r.exact(_TRAILER.size, "the trailer"))
        if magic != END_MAGIC:
            raise FormatError(f"bad stream trailer magic {magic!r}", offset=at)
        if t != total:
            raise SizeMismatchError(f"trailer says {t} data bytes, {total} arrived", offset=at + 8)
        if sd != digests.digest():
            raise ChecksumMismatchError("stream digest in the trailer does not match the frames", offset=at + 16)
        extra = unread() if unread is not None else 0
        if extra:
            raise FormatError(f"{extra} bytes follow the stream trailer (nothing may)", offset=r.offset)
        os.rename(tmp, final)
        placed = True
        CheckpointReader(final)  # the MANIFEST parses and names exactly these files
    except BaseException:
        shutil.rmtree(final if placed else tmp, ignore_errors=True)
        raise
    return StreamInfo(sd, total, tuple(files), dict(h["meta"]), path=final, wire_bytes=r.offset)
