"""Reading checkpoints: open (lazy), verify, and load (in place or into fresh tensors).

Opening reads only MANIFEST and a directory listing, and checks structure: names,
sizes, file types, nothing missing and nothing extra. Tensor bytes are read on
demand and every chunk they touch is verified against the digests written at save
time, unless the caller opts out. Nothing in this module imports torch at import
time: ``ckpt inspect`` and ``ckpt verify`` use it without torch.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ._pipeline import OrderedFeeder
from .errors import (
    ChecksumMismatchError,
    CheckpointNotFoundError,
    FormatError,
    IncompleteCheckpointError,
    LimitExceededError,
    MissingFileError,
    SizeMismatchError,
    UnexpectedFileError,
    UnsafePathError,
)
from .format.codec import zstd_decompress
from .format.digest import DIGEST_SIZE, ChunkHasher, chunk_count
from .format.manifest import MANIFEST_NAME, content_id, FileEntry, Manifest, PartEntry, TensorEntry, decode_manifest
from .format.safetensors import check_against_manifest, parse_header
from .format.tree import decode_tree
from .knobs import knobs
from .storage import Storage, local, preadv_full

__all__ = ["CheckpointReader", "open_checkpoint", "VerifyReport", "TMP_PREFIX"]

TMP_PREFIX = ".tmp-"


@dataclass(slots=True)
class VerifyReport:
    path: str
    files: int = 0
    chunks: int = 0
    bytes: int = 0
    quick: bool = False


class _ChunkVerifier:
    """Compares each chunk's digest as soon as the chunk is complete."""

    def __init__(self, path: str, entry: FileEntry) -> None:
        self.path = path
        self.entry = entry
        self.hasher = ChunkHasher(entry.chunk_size, self._check)

    def _check(self, idx: int, digest: bytes) -> None:
        want = self.entry.digests[idx * DIGEST_SIZE : (idx + 1) * DIGEST_SIZE]
        if digest != want:
            cs = self.entry.chunk_size
            lo, hi = idx * cs, min((idx + 1) * cs, self.entry.size)
            raise ChecksumMismatchError(
                f"chunk {idx} (bytes {lo}..{hi}) does not match its digest",
                path=self.path,
                offset=lo,
                chunk=idx,
                byte_range=(lo, hi),
            )

    def update(self, data: Any) -> None:
        self.hasher.update(data)

    def finish(self) -> None:
        self.hasher.finish()


_PIPELINE_MIN_BYTES = 32 << 20


class _PipelinedVerifier:
    """A _ChunkVerifier fed from one background thread, in submission order.

    The first mismatch is raised by the next ``update`` or by ``finish``, so a corrupt
    chunk stops the load within one tensor of where it was found.
    """

    def __init__(self, inner: _ChunkVerifier) -> None:
        self._inner = inner
        self._feeder = OrderedFeeder(inner.update, "ckpt-verify")

    def update(self, data: Any) -> None:
        self._feeder.feed(data)

    def finish(self) -> None:
        self._feeder.finish()
        self._inner.finish()

    def abort(self) -> None:
        self._feeder.abort()


def _parallel_reads(fd: int, fp: str, jobs: list[tuple[TensorEntry, memoryview]], request: int) -> None:
    """Read (tensor, destination) pairs in ``request``-sized pieces on two threads."""
    pieces: list[tuple[TensorEntry, memoryview, int]] = []
    for t, dst in jobs:
        mv = dst.cast("B") if dst.format != "B" or dst.ndim != 1 else dst
        for lo in range(0, t.nbytes, request):
            pieces.append((t, mv[lo : lo + request], lo))

    def run(share: list[tuple[TensorEntry, memoryview, int]]) -> None:
        for t, piece, lo in share:
            got = preadv_full(fd, piece, t.offset + lo, request)
            if got != len(piece):
                raise SizeMismatchError("file ended inside a tensor", path=fp, offset=t.offset + lo + got, key=t.key)

    errors: list[BaseException] = []

    def guarded(share: list[tuple[TensorEntry, memoryview, int]]) -> None:
        try:
            run(share)
        except BaseException as e:  # re-raised by the caller
            errors.append(e)

    helper = threading.Thread(target=guarded, args=(pieces[1::2],), name="ckpt-read", daemon=True)
    helper.start()
    guarded(pieces[0::2])
    helper.join()
    if errors:
        raise errors[0]


class CheckpointReader:
    """A committed checkpoint, opened lazily. Create with :func:`ckpt.open`."""

    def __init__(self, path: str | os.PathLike[str], *, storage: Storage = local) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self._storage = storage
        self.manifest: Manifest = self._open()
        self._trees: dict[str, Any] = {}
        self._headers: dict[str, tuple[int, dict]] = {}

    # -- structure ---------------------------------------------------------------------
    def _open(self) -> Manifest:
        p = self.path
        try:
            st = self._storage.lstat(p)
        except FileNotFoundError:
            raise CheckpointNotFoundError("no checkpoint at this path", path=p) from None
        if stat.S_ISLNK(st.st_mode):
            # Following a symlinked checkpoint is fine for users, but resolve it so every
            # later containment check is against the real directory.
            self.path = p = os.path.realpath(p)
            st = self._storage.lstat(p)
        if not stat.S_ISDIR(st.st_mode):
            raise FormatError("a checkpoint is a directory; this is not one", path=p)
        # After resolving: a link named "latest" to a temporary dir is still temporary.
        if os.path.basename(p).startswith(TMP_PREFIX):
            raise IncompleteCheckpointError("temporary directory of an unfinished save, not a checkpoint", path=p)
        mpath = os.path.join(p, MANIFEST_NAME)
        try:
            mst = self._storage.lstat(mpath)
        except FileNotFoundError:
            raise IncompleteCheckpointError("no MANIFEST: the save never committed", path=p) from None
        if not stat.S_ISREG(mst.st_mode):
            raise UnsafePathError("MANIFEST is not a regular file", path=mpath)
        limit = knobs().max_manifest_bytes + 64
        if mst.st_size > limit:
            raise LimitExceededError(f"MANIFEST is {mst.st_size} bytes, above the limit", path=mpath)
        manifest = decode_manifest(self._storage.read(mpath, 0, mst.st_size), path=mpath)
        if content_id(manifest.parts) != manifest.id:
            # The manifest digest covers the id, so this only trips on a writer bug or a
            # hand-edited manifest that was re-signed: either way not what was written.
            raise ChecksumMismatchError("manifest id does not match the digest of its parts", path=mpath, key="id")
        self._check_files(manifest)
        return manifest

    def _check_files(self, m: Manifest) -> None:
        expected = {MANIFEST_NAME}
        for f in m.files:
            fp = os.path.join(self.path, f.name)
            expected.add(f.name)
            try:
                st = self._storage.lstat(fp)
            except FileNotFoundError:
                raise MissingFileError("file named in the manifest is missing", path=fp) from None
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePathError("checkpoint files must not be symlinks", path=fp, target=os.readlink(fp))
            if not stat.S_ISREG(st.st_mode):
                raise UnsafePathError("checkpoint file is not a regular file", path=fp)
            if st.st_size != f.size:
                raise SizeMismatchError(
                    f"file is {st.st_size} bytes, manifest says {f.size}", path=fp, offset=min(st.st_size, f.size)
                )
        extra = [n for n in self._storage.listdir(self.path) if n not in expected]
        if extra:
            raise UnexpectedFileError(f"files not named in the manifest: {extra[:5]}", path=os.path.join(self.path, extra[0]))

    @property
    def parts(self) -> tuple[PartEntry, ...]:
        return self.manifest.parts

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.meta

    @property
    def step(self) -> int | None:
        return self.manifest.step

    def part(self, name: str | None = None) -> PartEntry:
        try:
            return self.manifest.part(name)
        except KeyError as e:
            raise FormatError(str(e.args[0]), path=self.path, key=name) from None

    def _fp(self, f: FileEntry) -> str:
        return os.path.join(self.path, f.name)

    # -- structure files ------------------------------------------------------------------
    def _read_verified(self, f: FileEntry, verify: bool) -> bytes:
        data = self._storage.read(self._fp(f), 0, f.size)
        if len(data) != f.size:
            raise SizeMismatchError(f"read {len(data)} of {f.size} bytes", path=self._fp(f), offset=len(data))
        if verify:
            v = _ChunkVerifier(self._fp(f), f)
            v.update(data)
            v.finish()
        return data

    def tree(self, part: str | None = None, *, verify: bool = True) -> dict[str, Any]:
        """The decoded structure file of a part: ``{"state": ..., "context": ...}``."""
        pe = self.part(part)
        if pe.name not in self._trees:
            f = pe.file("state")
            assert f is not None  # the manifest validator guarantees one
            raw = self._read_verified(f, verify)
            if f.codec == "zstd":
                raw = zstd_decompress(raw, f.raw_size or 0, path=self._fp(f))
            tree = decode_tree(raw, path=self._fp(f))
            if not isinstance(tree, dict) or not isinstance(tree.get("state"), dict) or not isinstance(tree.get("context"), dict):
                raise FormatError("structure file lacks its state/context maps", path=self._fp(f), offset=0)
            self._trees[pe.name] = tree
        return self._trees[pe.name]

    def context(self, part: str | None = None) -> dict[str, Any]:
        return self.tree(part)["context"]

    # -- tensors -------------------------------------------------------------------------
    def tensor_entries(self, part: str | None = None) -> tuple[TensorEntry, ...]:
        return self.part(part).tensors

    def _header(self, pe: PartEntry) -> None:
        f = pe.file("tensors")
        if f is None or pe.name in self._headers:
            return
        fp = self._fp(f)
        prefix = self._storage.read(fp, 0, 8)
        n, _ = parse_header(prefix, f.size, path=fp)
        full = self._storage.read(fp, 0, 8 + n)
        n, header = parse_header(full, f.size, path=fp)
        check_against_manifest(header, n, f.size, pe.tensors, path=fp)
        self._headers[pe.name] = (n, header)

    def _entry(self, key: str, part: str | None) -> tuple[PartEntry, TensorEntry]:
        pe = self.part(part)
        for t in pe.tensors:
            if t.key == key:
                return pe, t
        raise FormatError("no such tensor in this checkpoint", path=self.path, key=key)

    def read_tensor_bytes_into(self, pe: PartEntry, t: TensorEntry, dst: memoryview, *, verify: bool = True) -> None:
        """Read one tensor's bytes into ``dst``, verifying every chunk it overlaps."""
        self._header(pe)
        f = pe.files[t.file]
        fp = self._fp(f)
        if not verify:
            got = self._storage.pread_into(fp, t.offset, dst)
            if got != t.nbytes:
                raise SizeMismatchError("file ended inside a tensor", path=fp, offset=t.offset + got, key=t.key)
            return
        cs = f.chunk_size
        first = t.offset // cs
        last = (t.offset + t.nbytes - 1) // cs if t.nbytes else first - 1
        if last < first:
            return
        lo, hi = first * cs, min((last + 1) * cs, f.size)
        # Read whole chunks into a scratch buffer (a lazy read of one tensor touches at
        # most two extra partial chunks), verify, then copy out.
        buf = bytearray(hi - lo)
        got = self._storage.pread_into(fp, lo, memoryview(buf))
        if got != hi - lo:
            raise SizeMismatchError("file ended inside a tensor", path=fp, offset=lo + got, key=t.key)
        view = memoryview(buf)
        for idx in range(first, last + 1):
            a, b = idx * cs - lo, min((idx + 1) * cs, f.size) - lo
            if _digest(view[a:b]) != f.digests[idx * DIGEST_SIZE : (idx + 1) * DIGEST_SIZE]:
                raise ChecksumMismatchError(
                    f"chunk {idx} (bytes {lo + a}..{lo + b}) does not match its digest",
                    path=fp,
                    offset=lo + a,
                    key=t.key,
                    chunk=idx,
                )
        dst[:] = view[t.offset - lo : t.offset - lo + t.nbytes]

    def stream_part_into(
        self,
        pe: PartEntry,
        destinations: Callable[[TensorEntry], memoryview],
        *,
        verify: bool = True,
    ) -> None:
        """Read every tensor of a part in file order straight into caller memory.

        Verification hashes the destination memory right after each read, so a full
        load costs one read and one hash pass, with no scratch copy. Because tensors
        tile the data region (checked against the safetensors header), the hashed
        ranges cover every byte of the file.
        """
        f = pe.file("tensors")
        if f is None:
            return
        self._header(pe)
        n, _ = self._headers[pe.name]
        fp = self._fp(f)
        fd = os.open(fp, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
        verifier: _ChunkVerifier | _PipelinedVerifier | None = None
        try:
            if verify:
                # Large parts hash on a second thread while the next tensor is read
                # (preadv and xxh3 both release the GIL), so verification overlaps I/O.
                verifier = _ChunkVerifier(fp, f)
                if f.size >= _PIPELINE_MIN_BYTES:
                    verifier = _PipelinedVerifier(verifier)
                head = bytearray(8 + n)
                preadv_full(fd, memoryview(head), 0)
                verifier.update(head)
            request = knobs().read_request
            ordered = sorted(pe.tensors, key=lambda e: e.offset)
            if verifier is None and f.size >= _PIPELINE_MIN_BYTES:
                # Without hashing, the second core has nothing to do: split the reads
                # between two threads (the kernel copy from the page cache is the cost).
                _parallel_reads(fd, fp, [(t, destinations(t)) for t in ordered], request)
                ordered = []
            for t in ordered:
                dst = destinations(t)
                got = preadv_full(fd, dst, t.offset, request)
                if got != t.nbytes:
                    raise SizeMismatchError("file ended inside a tensor", path=fp, offset=t.offset + got, key=t.key)
                if verifier is not None:
                    verifier.update(dst)
            if verifier is not None:
                verifier.finish()
                verifier = None
        finally:
            if isinstance(verifier, _PipelinedVerifier):
                verifier.abort()
            os.close(fd)

    # -- verification ----------------------------------------------------------------------
    def verify(self, *, quick: bool = False, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Re-hash every chunk of every file (or, with ``quick``, structure and sizes)."""
        report = VerifyReport(self.path, quick=quick)
        for pe in self.parts:
            self._header(pe)
            self.tree(pe.name, verify=not quick)
            for f in pe.files:
                report.files += 1
                if quick:
                    continue
                fp = self._fp(f)
                v = _ChunkVerifier(fp, f)
                fd = os.open(fp, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
                try:
                    buf = bytearray(f.chunk_size)
                    mv = memoryview(buf)
                    for idx in range(chunk_count(f.size, f.chunk_size)):
                        want = min(f.chunk_size, f.size - idx * f.chunk_size)
                        got = preadv_full(fd, mv[:want], idx * f.chunk_size)
                        if got != want:
                            raise SizeMismatchError("file shorter than its manifest size", path=fp, offset=idx * f.chunk_size + got)
                        v.update(mv[:want])
                        report.chunks += 1
                        report.bytes += want
                        if progress is not None:
                            progress(want)
                    v.finish()
                finally:
                    os.close(fd)
        return report

    def iter_tensor_keys(self, part: str | None = None) -> Iterator[str]:
        return (t.key for t in self.part(part).tensors)

    # -- torch-facing conveniences (import torch lazily) -------------------------------
    def tensor(self, key: str, *, part: str | None = None, map_location: Any = None, verify: bool = True) -> Any:
        """Read one tensor lazily: only the chunks it overlaps are read and verified."""
        from ._torchio import read_tensor

        pe, t = self._entry(key, part)
        return read_tensor(self, pe, t, map_location=map_location, verify=verify)

    def state(
        self, part: str | None = None, *, map_location: Any = None, verify: bool = True, mmap: bool = False
    ) -> dict[str, Any]:
        """The whole saved state of a part, as plain trees of fresh tensors.

        ``mmap=True`` backs the tensors by a private copy-on-write mapping of the file
        instead of reading them into new memory (faster; see ``_torchio._mmap_fresh``
        for the one caveat: do not truncate the file while the tensors are alive).
        """
        from ._torchio import materialize_state

        if part is None and "sharded" in self.meta:  # sharded hook: global tensors (ckpt.dcp)
            from .dcp.full import full_state

            return full_state(self, verify=verify)
        return materialize_state(self, self.part(part), map_location=map_location, verify=verify, mmap=mmap)


def _digest(b: Any) -> bytes:
    from .format.digest import digest_bytes

    return digest_bytes(b)


def open_checkpoint(path: str | os.PathLike[str], *, storage: Storage = local) -> CheckpointReader:
    return CheckpointReader(path, storage=storage)
