"""Reading checkpoints: open (lazy), verify, and load (in place or into fresh tensors).

Opening reads only MANIFEST and a directory listing, and checks structure: names,
sizes, file types, nothing missing and nothing extra. Tensor bytes are read on
demand and every chunk they touch is verified against the digests written at save
time, unless the caller opts out. Nothing in this module imports torch at import
time: ``ckpt inspect`` and ``ckpt verify`` use it without torch.
"""

from __future__ import annotations

import os
import queue
import stat
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ._gc import paused as gc_paused
from ._pipeline import OrderedFeeder
from ._statecheck import check_part
from .errors import (
    ChecksumMismatchError,
    CheckpointNotFoundError,
    CheckpointVanishedError,
    CkptError,
    FormatError,
    IncompleteCheckpointError,
    LimitExceededError,
    MissingFileError,
    NotACheckpointError,
    SizeMismatchError,
    UnexpectedFileError,
    UnsafePathError,
)
from .format.codec import unpackb, value_limit, zstd_decompress
from .format.digest import DIGEST_SIZE, ChunkHasher, chunk_count
from .format.context import check_context, check_entry_names
from .format.manifest import (
    MANIFEST_NAME,
    TMP_PREFIX,
    FileEntry,
    Manifest,
    PartEntry,
    PartRef,
    TensorEntry,
    decode_manifest,
    decode_part_manifest,
)
from .format.safetensors import check_against_manifest, parse_header
from .format.tree import DeviceRef, DtypeRef, TensorRef, decode_tree
from .knobs import knobs
from .storage import ReadHandle, Storage, resolve

__all__ = ["CheckpointReader", "open_checkpoint", "VerifyReport", "TMP_PREFIX"]


@dataclass(slots=True)
class VerifyReport:
    path: str
    files: int = 0
    chunks: int = 0
    bytes: int = 0
    quick: bool = False
    shared: int = 0  # files shared with an earlier checkpoint (format 2.0 dedup)


class _DigestCheck:
    """Hash each tensor's values from the pieces of its file as verification reads them,
    and compare with the entry's ``digest`` (format-2.md §V.6). Packed tensors are decoded
    block by block into one reused buffer."""

    def __init__(self, path: str, entries: list[TensorEntry]) -> None:
        self.path = path
        self._todo = sorted(entries, key=lambda t: t.offset)
        self._i = 0
        self._cur: tuple[TensorEntry, Any, Any] | None = None  # (entry, hasher, decoder)

    def __bool__(self) -> bool:
        return bool(self._todo)

    def _start(self, t: TensorEntry) -> None:
        import xxhash

        from .format import bpz, dtypes

        h = xxhash.xxh3_128()
        dec = None
        if t.encoding is not None:
            dec = bpz.SpanDecoder(None, dtypes.itemsize(t.dtype), t.stored_nbytes, path=self.path, offset=t.offset,
                                  key=t.key, nbytes=t.nbytes, sink=h.update)
        self._cur = (t, h, dec)

    def observe(self, at: int, piece: memoryview) -> None:
        end = at + len(piece)
        while True:
            if self._cur is None:
                if self._i >= len(self._todo) or self._todo[self._i].offset >= end:
                    return
                self._start(self._todo[self._i])
                self._i += 1
            t, h, dec = self._cur  # type: ignore[misc]
            lo, hi = t.offset, t.offset + t.stored_nbytes
            a, b = max(lo, at), min(hi, end)
            if a < b:
                (dec.feed if dec is not None else h.update)(piece[a - at : b - at])
            if hi > end:
                return
            self._done()

    def _done(self) -> None:
        t, h, dec = self._cur  # type: ignore[misc]
        self._cur = None
        if dec is not None:
            dec.finish()
        if h.digest() != t.digest:
            raise ChecksumMismatchError(
                "tensor values do not match the digest the manifest records", path=self.path, offset=t.offset, key=t.key
            )

    def finish(self) -> None:
        if self._cur is not None or self._i < len(self._todo):
            raise SizeMismatchError("file ended before the tensors its manifest lists", path=self.path)


class _ChunkVerifier:
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


_PIPELINE_MIN_BYTES = 32 << 20
#: the most a verifying read holds beside its destination (verify, lazy tensor reads)
_VERIFY_PIECE = 8 << 20


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


def _parallel_reads(handle: ReadHandle, fp: str, jobs: list[tuple[TensorEntry, memoryview]], request: int) -> None:
    """Read (tensor, destination) pairs in ``request``-sized pieces on two threads."""
    pieces: list[tuple[TensorEntry, memoryview, int]] = []
    for t, dst in jobs:
        mv = dst.cast("B") if dst.format != "B" or dst.ndim != 1 else dst
        for lo in range(0, t.nbytes, request):
            pieces.append((t, mv[lo : lo + request], lo))

    def run(share: list[tuple[TensorEntry, memoryview, int]]) -> None:
        for t, piece, lo in share:
            got = handle.pread_into(t.offset + lo, piece)
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

    def __init__(self, path: str | os.PathLike[str], *, storage: Storage | None = None) -> None:
        # The one resolver: a plain path is local, s3://... the object-store backend,
        # any other URL a clear UnsupportedSchemeError (never a local folder "s3:").
        self._storage, self.path = resolve(path, storage)
        self._manifest_bytes = b""
        self.manifest: Manifest = self._open()
        self._trees: dict[str, Any] = {}
        self._headers: dict[tuple[str, int], tuple[int, dict]] = {}  # (part, file index) -> safetensors header

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
            self.path = p = self._storage.realpath(p)
            st = self._storage.lstat(p)
        if not stat.S_ISDIR(st.st_mode):
            raise _not_a_checkpoint(p, self._storage)
        # After resolving: a link named "latest" to a temporary dir is still temporary.
        if os.path.basename(p).startswith(TMP_PREFIX):
            raise IncompleteCheckpointError("temporary directory of an unfinished save, not a checkpoint", path=p)
        mpath = os.path.join(p, MANIFEST_NAME)
        try:
            mst = self._storage.lstat(mpath)
        except FileNotFoundError:
            try:
                self._storage.lstat(p)
            except FileNotFoundError:  # the directory itself went away after the first lstat
                raise CheckpointVanishedError("the checkpoint was removed while it was being opened", path=p) from None
            raise _not_a_checkpoint(p, self._storage) from None
        if not stat.S_ISREG(mst.st_mode):
            raise UnsafePathError("MANIFEST is not a regular file", path=mpath)
        limit = knobs().max_manifest_bytes + 64
        if mst.st_size > limit:
            raise LimitExceededError(f"MANIFEST is {mst.st_size} bytes, above the limit", path=mpath)
        try:
            data = self._storage.read(mpath, 0, mst.st_size)
            self._manifest_bytes = data
        except FileNotFoundError:
            raise CheckpointVanishedError("MANIFEST was removed while the checkpoint was being opened", path=mpath) from None
        with gc_paused():
            manifest = decode_manifest(data, path=mpath)  # also recomputes the content id (§5.2)
        # Part references (format 2.0 §V.5) are read when their part is first needed.
        manifest.parts.bind(lambda ref: self._load_part(ref, manifest))
        try:
            self._check_files(manifest)
        except MissingFileError:
            self._raise_if_vanished()
            raise
        return manifest

    def _raise_if_vanished(self) -> None:
        """Retention and replacement rename a checkpoint away before deleting it, so a
        path that stops existing under a reader means "removed", not "corrupt"."""
        mpath = os.path.join(self.path, MANIFEST_NAME)
        try:
            self._storage.lstat(mpath)
            now = self._storage.read(mpath, 0, len(self._manifest_bytes) + 1)
        except FileNotFoundError:
            raise CheckpointVanishedError(
                "the checkpoint was removed while it was being read (e.g. by retention)", path=self.path
            ) from None
        if now != self._manifest_bytes:
            # Replaced by another save of the same name (overwrite): the files this
            # reader opened belong to the old one.
            raise CheckpointVanishedError("the checkpoint was replaced while it was being read", path=self.path)

    def _load_part(self, ref: PartRef, m: Manifest) -> PartEntry:
        fp = os.path.join(self.path, ref.manifest)
        data = self._read(fp, 0, ref.manifest_size)
        return decode_part_manifest(data, ref, m.version, path=fp)

    def _check_files(self, m: Manifest) -> None:
        expected = {MANIFEST_NAME}
        for name, size, _ in m.parts.file_sizes():
            f = FileEntry(name, "", size, 0, b"")
            fp = os.path.join(self.path, f.name)
            expected.add(f.name)
            try:
                st = self._storage.lstat(fp)
            except FileNotFoundError:
                raise MissingFileError("file named in the manifest is missing", path=fp) from None
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePathError("checkpoint files must not be symlinks", path=fp, target=self._storage.readlink(fp))
            if not stat.S_ISREG(st.st_mode):
                raise UnsafePathError("checkpoint file is not a regular file", path=fp)
            if st.st_size != f.size:
                raise SizeMismatchError(
                    f"file is {st.st_size} bytes, manifest says {f.size}", path=fp, offset=min(st.st_size, f.size)
                )
        if not getattr(self._storage, "strict_listing", True):
            # An object store: objects a committed MANIFEST does not name are leftovers
            # of other saves (a lost race, a crash, a replaced checkpoint); they are
            # never read, and orphan cleanup removes them (spec/object-storage.md §O.4).
            return
        try:
            listing = self._storage.listdir(self.path)
        except FileNotFoundError:
            raise CheckpointVanishedError("the checkpoint was removed while it was being opened", path=self.path) from None
        extra = [n for n in listing if n not in expected]
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

    @property
    def storage(self) -> Storage:
        """The backend this checkpoint is read through (``ckpt.storage``)."""
        return self._storage

    def _open_handle(self, fp: str, *, reread: bool = False) -> ReadHandle:
        try:
            return self._storage.open_read(fp, reread=True) if reread else self._storage.open_read(fp)
        except FileNotFoundError:
            self._raise_if_vanished()
            raise MissingFileError("file named in the manifest is missing", path=fp) from None

    # -- structure files ------------------------------------------------------------------
    def _read(self, fp: str, offset: int, size: int) -> bytes:
        try:
            return self._storage.read(fp, offset, size)
        except FileNotFoundError:
            self._raise_if_vanished()
            raise MissingFileError("file named in the manifest is missing", path=fp) from None

    def _read_verified(self, f: FileEntry, verify: bool) -> bytes:
        data = self._read(self._fp(f), 0, f.size)
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
            with gc_paused():
                tree = decode_tree(raw, path=self._fp(f), max_value=value_limit(f.size))
                if not isinstance(tree, dict) or not isinstance(tree.get("state"), dict) or not isinstance(tree.get("context"), dict):
                    raise FormatError("structure file lacks its state/context maps", path=self._fp(f), offset=0)
                check_entry_names(tree["state"], path=self._fp(f))
                check_context(tree["context"], path=self._fp(f))
            self._trees[pe.name] = tree
        return self._trees[pe.name]

    def context(self, part: str | None = None) -> dict[str, Any]:
        """A part's context (step, rng, data, config, topology, commit, env, lineage, extra).

        Reads only the structure file, except where a field (``extra``, ``data``, ...)
        holds tensors, dtypes or devices, as values or map keys: tensors are read
        (verified), and each is returned as itself, never as a placeholder."""
        ctx = self.tree(part)["context"]
        held = [k for k, v in ctx.items() if _holds_ref(v)]
        if not held:
            return ctx
        from ._materialize import resolve_lazily

        pe = self.part(part)
        return {**ctx, **{k: resolve_lazily(self, pe, ctx[k]) for k in held}}

    def config(self, part: str | None = None) -> Any:
        """The config saved with ``config=`` (its canonical form: maps, lists, plain values),
        or None when the save had none. Reads only the part's small structure file, never
        a tensor: read it first, then build the model (``ckpt.open(p).config()["model"]``)."""
        cfg = self.tree(part)["context"].get("config")
        if not cfg:
            return None
        pe = self.part(part)
        where = self._fp(pe.file("state")) if pe.file("state") is not None else self.path
        return unpackb(cfg["canonical"], path=where, what="config")

    def entries(self, part: str | None = None) -> tuple[str, ...]:
        """The names of a part's top-level state entries (``"model"``, ``"optim"``, ...)."""
        return tuple(self.tree(part)["state"])

    # -- tensors -------------------------------------------------------------------------
    def tensor_entries(self, part: str | None = None) -> tuple[TensorEntry, ...]:
        return self.part(part).tensors

    def _header(self, pe: PartEntry, index: int | None = None) -> None:
        """Parse and check the safetensors header of tensor file ``index`` (every one of
        the part's when None) against the entries that reference it (§6.1, §V.2.4)."""
        for i in (pe.data_files() if index is None else [index]):
            f = pe.files[i]
            if f.role != "tensors" or (pe.name, i) in self._headers:
                continue
            fp = self._fp(f)
            prefix = self._read(fp, 0, 8)
            n, _ = parse_header(prefix, f.size, path=fp)
            full = self._read(fp, 0, 8 + n)
            with gc_paused():
                n, header = parse_header(full, f.size, path=fp)
                check_against_manifest(header, n, f.size, pe.tensors_in(i), path=fp, shared=f.origin is not None)
            self._headers[(pe.name, i)] = (n, header)

    def _entry(self, key: str, part: str | None) -> tuple[PartEntry, TensorEntry]:
        pe = self.part(part)
        for t in pe.tensors:
            if t.key == key:
                return pe, t
        raise FormatError("no such tensor in this checkpoint", path=self.path, key=key)

    def read_tensor_bytes_into(
        self, pe: PartEntry, t: TensorEntry, dst: memoryview, *, verify: bool = True, handle: ReadHandle | None = None
    ) -> None:
        """Read one tensor's bytes into ``dst``, verifying every chunk it overlaps.

        ``handle``: read through this open file of the tensor (see :meth:`open_data_file`)
        instead of through the storage by path. Only the chunks the tensor overlaps are
        read (ranged requests on an object store). A packed tensor (format 2.0) is decoded
        into ``dst`` from the chunks its span overlaps.
        """
        if t.encoding is not None:
            self._read_encoded_into(pe, t, dst, verify=verify, handle=handle)
            return
        self._header(pe, t.file)
        f = pe.files[t.file]
        fp = self._fp(f)

        def pread_into(offset: int, buf: memoryview) -> int:
            if handle is not None:
                return handle.pread_into(offset, buf)
            return self._storage.pread_into(fp, offset, buf)

        if not verify:
            got = pread_into(t.offset, dst)
            if got != t.nbytes:
                raise SizeMismatchError("file ended inside a tensor", path=fp, offset=t.offset + got, key=t.key)
            return
        cs = f.chunk_size
        first = t.offset // cs
        last = (t.offset + t.nbytes - 1) // cs if t.nbytes else first - 1
        if last < first:
            return
        lo, hi = first * cs, min((last + 1) * cs, f.size)
        # Hash the chunks the tensor overlaps in pieces of at most _VERIFY_PIECE bytes,
        # copying the tensor's bytes out as they pass: memory is the tensor plus one
        # piece, never a whole declared chunk (a MANIFEST may declare 1 GiB chunks).
        # When the chunks fit one piece (the usual case: 4 MiB chunks, small tensors),
        # dst is written only after every chunk it overlaps has matched; a longer range
        # is copied as it is verified, so after an error dst may hold part of the bytes.
        if dst.format != "B" or dst.ndim != 1:
            dst = dst.cast("B")
        try:
            whole = hi - lo <= _VERIFY_PIECE
            scratch = memoryview(bytearray(min(hi - lo, _VERIFY_PIECE)))
            verifier = _ChunkVerifier(fp, f, first=first, key=t.key)
            pos = lo
            while pos < hi:
                n = min(len(scratch), hi - pos)
                piece = scratch[:n]
                got = pread_into(pos, piece)
                if got != n:
                    raise SizeMismatchError("file ended inside a tensor", path=fp, offset=pos + got, key=t.key)
                verifier.update(piece)
                a, b = max(pos, t.offset), min(pos + n, t.offset + t.nbytes)
                if a < b and not whole:
                    dst[a - t.offset : b - t.offset] = piece[a - pos : b - pos]
                pos += n
            verifier.finish()
            if whole:
                dst[:] = scratch[t.offset - lo : t.offset - lo + t.nbytes]
        except FileNotFoundError:
            self._raise_if_vanished()
            raise MissingFileError("file named in the manifest is missing", path=fp) from None

    def read_tensors_into(
        self, pe: PartEntry, items: list[tuple[TensorEntry, memoryview]], *, verify: bool = True
    ) -> None:
        """Read several tensors of one part into fresh memory, hashing each chunk they
        overlap once: tensors whose chunks touch are read as one run, in file order.

        For fresh destinations only (``state(ENTRY)``, an export): bytes are copied out as
        their piece is read, so after an error a destination may hold part of its bytes.
        Reading tensors one by one would hash a whole chunk for each small tensor in it.
        """
        if not items:
            return  # a tensor-free entry never touches the tensor file
        # Packed tensors (format 2.0) decode span by span; unverified reads need no runs.
        single = [(t, dst) for t, dst in items if not verify or t.encoding is not None]
        for t, dst in single:
            self.read_tensor_bytes_into(pe, t, dst, verify=verify)
        plain = [(t, dst) for t, dst in items if verify and t.encoding is None]
        for index in sorted({t.file for t, _ in plain}):  # 2.0: a part's tensors may span files
            self._read_runs_into(pe, index, [(t, dst) for t, dst in plain if t.file == index])

    def _read_runs_into(self, pe: PartEntry, index: int, items: list[tuple[TensorEntry, memoryview]]) -> None:
        """``read_tensors_into`` for the plain tensors of one data file."""
        self._header(pe, index)
        f = pe.files[index]
        fp, cs = self._fp(f), f.chunk_size
        runs: list[tuple[int, int, list[tuple[TensorEntry, memoryview]]]] = []
        for t, dst in sorted(items, key=lambda it: it[0].offset):
            if not t.nbytes:
                continue
            first, last = t.offset // cs, (t.offset + t.nbytes - 1) // cs
            if runs and first <= runs[-1][1] + 1:
                runs[-1] = (runs[-1][0], max(runs[-1][1], last), runs[-1][2] + [(t, dst)])
            else:
                runs.append((first, last, [(t, dst)]))
        try:
            for first, last, group in runs:
                lo, hi = first * cs, min((last + 1) * cs, f.size)
                verifier = _ChunkVerifier(fp, f, first=first)
                scratch = memoryview(bytearray(min(hi - lo, _VERIFY_PIECE)))
                pos, k = lo, 0
                while pos < hi:
                    n = min(len(scratch), hi - pos)
                    piece = scratch[:n]
                    got = self._storage.pread_into(fp, pos, piece)
                    if got != n:
                        raise SizeMismatchError("file ended inside a tensor", path=fp, offset=pos + got)
                    verifier.update(piece)
                    while k < len(group) and group[k][0].offset + group[k][0].nbytes <= pos:
                        k += 1  # tensors that ended before this piece
                    for t, dst in group[k:]:
                        if t.offset >= pos + n:
                            break
                        a, b = max(pos, t.offset), min(pos + n, t.offset + t.nbytes)
                        if a < b:
                            out = dst.cast("B") if dst.format != "B" or dst.ndim != 1 else dst
                            out[a - t.offset : b - t.offset] = piece[a - pos : b - pos]
                    pos += n
                verifier.finish()
        except FileNotFoundError:
            self._raise_if_vanished()
            raise MissingFileError("file named in the manifest is missing", path=fp) from None

    def _read_encoded_into(
        self, pe: PartEntry, t: TensorEntry, dst: memoryview, *, verify: bool, handle: ReadHandle | None
    ) -> None:
        """Decode a BPZ1 span (format-2.md §V.3) into ``dst``: the chunks the span overlaps
        are read in pieces of at most _VERIFY_PIECE, each hashed before it is decoded."""
        from .format import bpz, dtypes  # numpy: only when a packed tensor is read (inspect stays light)

        f = pe.files[t.file]
        fp = self._fp(f)
        stored = t.stored_nbytes
        dec = bpz.SpanDecoder(dst, dtypes.itemsize(t.dtype), stored, path=fp, offset=t.offset, key=t.key)
        cs = f.chunk_size
        lo, hi = t.offset, t.offset + stored
        if verify:
            lo, hi = (lo // cs) * cs, min(((hi - 1) // cs + 1) * cs, f.size)
        verifier = _ChunkVerifier(fp, f, first=lo // cs, key=t.key) if verify else None
        scratch = memoryview(bytearray(min(hi - lo, _VERIFY_PIECE)))
        failed: FormatError | None = None
        stop = hi
        pos = lo
        try:
            while pos < stop:
                n = min(len(scratch), stop - pos)
                piece = scratch[:n]
                got = handle.pread_into(pos, piece) if handle is not None else self._storage.pread_into(fp, pos, piece)
                if got != n:
                    raise SizeMismatchError("file ended inside a tensor", path=fp, offset=pos + got, key=t.key)
                if verifier is not None:
                    verifier.update(piece)  # a corrupt chunk is named before its bytes are decoded
                a, b = max(pos, t.offset), min(pos + n, t.offset + stored)
                if failed is None and a < b:
                    try:
                        dec.feed(piece[a - pos : b - pos])
                    except FormatError as e:
                        # Hash on to the end of this chunk first: if its bytes are damaged,
                        # that is the error to report, not what the decoder made of them.
                        failed = e
                        if verifier is None:
                            raise
                        stop = min(((pos + n - 1) // cs + 1) * cs, f.size)
                pos += n
            if verifier is not None:
                verifier.finish()
            if failed is not None:
                raise failed
            dec.finish()
        except FileNotFoundError:
            self._raise_if_vanished()
            raise MissingFileError("file named in the manifest is missing", path=fp) from None

    def stream_part_into(
        self,
        pe: PartEntry,
        destinations: Callable[[TensorEntry], memoryview],
        *,
        verify: bool = True,
        handle: ReadHandle | None = None,
    ) -> None:
        """Read every tensor of a part straight into caller memory, file by file (see
        :meth:`stream_file_into`). ``handle``: the part's only data file, opened."""
        files = pe.data_files()
        if handle is not None and len(files) > 1:
            raise ValueError("one handle for a part with several tensor files")
        for i in files:
            self.stream_file_into(pe, i, destinations, verify=verify, handle=handle)

    def stream_file_into(
        self,
        pe: PartEntry,
        index: int,
        destinations: Callable[[TensorEntry], memoryview],
        *,
        verify: bool = True,
        handle: ReadHandle | None = None,
    ) -> None:
        """Read every tensor of data file ``index`` of a part into caller memory.

        A safetensors file written by this checkpoint is read in file order straight into
        the destinations: verification hashes the destination memory right after each
        read, so a full load costs one read and one hash pass, with no scratch copy, and
        because tensors tile the data region (checked against the safetensors header),
        the hashed ranges cover every byte of the file. A shared file (format 2.0, which
        may hold tensors this checkpoint does not reference) and a packed file are read
        tensor by tensor (:meth:`read_tensor_bytes_into`). ``handle``: read through this
        open file (from :meth:`open_data_file`; the caller closes it).
        """
        f = pe.files[index]
        entries = pe.tensors_in(index)
        if f.role == "packed" or f.origin is not None:
            own = handle is None
            if handle is None:
                handle = self.open_data_file(pe, index)
            ordered = sorted(entries, key=lambda e: e.offset)
            try:
                if f.role == "packed":
                    self._decode_file(f, ordered, destinations, verify=verify, handle=handle)
                else:
                    for t in ordered:
                        self.read_tensor_bytes_into(pe, t, destinations(t), verify=verify, handle=handle)
            finally:
                if own:
                    handle.close()
            return
        self._header(pe, index)
        n, _ = self._headers[(pe.name, index)]
        fp = self._fp(f)
        own = handle is None
        if handle is None:
            handle = self._open_handle(fp)
        verifier: _ChunkVerifier | _PipelinedVerifier | None = None
        try:
            if verify:
                # Large parts hash on a second thread while the next tensor is read
                # (preadv and xxh3 both release the GIL), so verification overlaps I/O.
                verifier = _ChunkVerifier(fp, f)
                if f.size >= _PIPELINE_MIN_BYTES:
                    verifier = _PipelinedVerifier(verifier)
                head = bytearray(8 + n)
                handle.pread_into(0, memoryview(head))
                verifier.update(head)
            request = knobs().read_request
            ordered = sorted(entries, key=lambda e: e.offset)
            if verifier is None and f.size >= _PIPELINE_MIN_BYTES:
                # Without hashing, the second core has nothing to do: split the reads
                # between two threads (the kernel copy from the page cache is the cost).
                _parallel_reads(handle, fp, [(t, destinations(t)) for t in ordered], request)
                ordered = []
            for t in ordered:
                dst = destinations(t)
                got = handle.pread_into(t.offset, dst)
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
            if own:
                handle.close()

    def _decode_file(
        self,
        f: FileEntry,
        ordered: list[TensorEntry],
        destinations: Callable[[TensorEntry], memoryview],
        *,
        verify: bool,
        handle: ReadHandle,
    ) -> None:
        """Decode every span of a packed file in one pass over it: each piece is hashed
        (on verify_file's second thread, while the next one is read) before it is decoded,
        so every byte is read and hashed once. A span that does not decode is reported only
        after the chunks are known good: damaged bytes are a checksum error, not a decoding
        one."""
        from collections import deque

        from .format import bpz, dtypes

        fp = self._fp(f)
        # Blocks decode on the codec threads while this thread reads and the verify
        # thread hashes: the plane merge and zstd are most of a packed load's time.
        pool = bpz.shared_pool(knobs().bpz_threads)
        spans = deque(
            (t, bpz.SpanDecoder(destinations(t), dtypes.itemsize(t.dtype), t.stored_nbytes, path=fp, offset=t.offset, key=t.key,
                                pool=pool))
            for t in ordered
        )
        decoders = [dec for _, dec in spans]
        failed: list[FormatError] = []

        def observe(at: int, piece: memoryview) -> None:
            end = at + len(piece)
            while spans:
                t, dec = spans[0]
                lo, hi = t.offset, t.offset + t.stored_nbytes
                if lo >= end:
                    return
                try:
                    if not failed:
                        a, b = max(lo, at), min(hi, end)
                        if a < b:
                            dec.feed(piece[a - at : b - at])
                        if hi <= end:
                            dec.finish()
                except FormatError as e:
                    failed.append(e)
                if hi > end:
                    return
                spans.popleft()

        try:
            if verify:
                self.verify_file(f, handle=handle, observe=observe)
            else:
                buf = memoryview(bytearray(min(f.size, _VERIFY_PIECE)))
                for pos in range(0, f.size, len(buf) or 1):
                    n = min(len(buf), f.size - pos)
                    got = handle.pread_into(pos, buf[:n])
                    if got != n:
                        raise SizeMismatchError("file shorter than its manifest size", path=fp, offset=pos + got)
                    observe(pos, buf[:n])
        finally:
            for dec in decoders:
                dec.wait()  # no block job writes a destination after this returns or raises
        if failed:
            raise failed[0]
        if spans:
            raise SizeMismatchError("file ended before the tensors its manifest lists", path=fp, key=spans[0][0].key)

    def open_data_file(self, pe: PartEntry, index: int, *, reread: bool = False) -> ReadHandle:
        """Check data file ``index``'s safetensors header (if it is one) and open it
        (caller closes it).

        A held local descriptor keeps reading the same bytes even if the checkpoint is
        renamed or deleted meanwhile (retention renames before it deletes); an object
        store handle pins the object's version, so a replaced or deleted object fails
        the read instead. An in-place load verifies and then copies through one handle
        per file. ``reread``: the caller reads the bytes twice (verify, then copy); an
        object store keeps the first pass's bytes locally instead of downloading twice.
        """
        self._header(pe, index)
        return self._open_handle(self._fp(pe.files[index]), reread=reread)

    def open_tensor_file(self, pe: PartEntry, *, reread: bool = False) -> tuple[ReadHandle, FileEntry] | None:
        """The part's one safetensors file, checked and opened (None if it has none); see
        :meth:`open_data_file` for parts with several data files."""
        files = pe.data_files()
        if not files:
            return None
        if len(files) > 1 or pe.files[files[0]].role != "tensors":
            raise ValueError(f"part {pe.name!r} has {len(files)} data files; open them with open_data_file")
        return self.open_data_file(pe, files[0], reread=reread), pe.files[files[0]]

    def verify_bytes(self, f: FileEntry, data: Any, *, first: int = 0) -> None:
        """Check content of file ``f``, already in memory, against its digests: the
        whole file, or (``first``) the chunks from number ``first`` on that ``data``
        covers, starting at that chunk's first byte (a share of a parallel check)."""
        v = _ChunkVerifier(self._fp(f), f, first=first)
        v.update(data)
        v.finish()

    def verify_file(
        self,
        f: FileEntry,
        *,
        handle: ReadHandle | None = None,
        span: tuple[int, int] | None = None,
        progress: Callable[[int], None] | None = None,
        observe: Callable[[int, memoryview], None] | None = None,
    ) -> int:
        """Re-hash every chunk of file ``f`` in bounded pieces; returns the bytes hashed.

        ``span=(lo, hi)``: only the chunks that bytes ``lo..hi`` overlap. ``observe(offset,
        piece)`` sees every piece, in file order, after it was hashed (verify checks tensor
        digests with it in the same pass).
        """
        fp = self._fp(f)
        cs = f.chunk_size
        lo, hi = (0, f.size) if span is None else span
        if hi <= lo:
            return 0
        first = lo // cs
        pos, end = first * cs, min(((hi - 1) // cs + 1) * cs, f.size)
        v = _ChunkVerifier(fp, f, first=first)
        own = handle is None
        if handle is None:
            handle = self._open_handle(fp)
        try:
            # The buffer follows the bytes read, never the declared chunk size: a
            # MANIFEST may declare 1 GiB chunks for a 4 KiB file (§12).
            start = pos
            if end - pos >= _PIPELINE_MIN_BYTES:
                # Two half pieces: one is hashed on a second thread while the next is read
                # (preadv and xxh3 release the GIL); memory stays one _VERIFY_PIECE.
                step = _VERIFY_PIECE // 2
                free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
                for _ in range(2):
                    free.put(memoryview(bytearray(step)))
                failed: list[BaseException] = []

                def consume(item: tuple[memoryview, int, int]) -> None:
                    buf, n, at = item
                    try:
                        if not failed:
                            v.update(buf[:n])
                            if observe is not None:
                                observe(at, buf[:n])
                    except BaseException as e:  # re-raised on the reading thread
                        failed.append(e)
                    finally:
                        free.put(buf)  # always returned, or the reader would wait forever

                feeder = OrderedFeeder(consume, "ckpt-verify")
                try:
                    while pos < end and not failed:
                        want = min(step, end - pos)
                        mv = free.get()
                        got = handle.pread_into(pos, mv[:want])
                        if got != want:
                            raise SizeMismatchError("file shorter than its manifest size", path=fp, offset=pos + got)
                        feeder.feed((mv, want, pos))
                        pos += want
                        if progress is not None:
                            progress(want)
                finally:
                    feeder.finish()
                if failed:
                    raise failed[0]
            else:
                step = min(cs, end - pos, _VERIFY_PIECE) or 1
                mv = memoryview(bytearray(step))
                while pos < end:
                    want = min(step, end - pos)
                    got = handle.pread_into(pos, mv[:want])
                    if got != want:
                        raise SizeMismatchError("file shorter than its manifest size", path=fp, offset=pos + got)
                    v.update(mv[:want])
                    if observe is not None:
                        observe(pos, mv[:want])
                    pos += want
                    if progress is not None:
                        progress(want)
            v.finish()
        finally:
            if own:
                handle.close()
        return pos - start

    # -- verification ----------------------------------------------------------------------
    def verify(self, *, quick: bool = False, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Re-hash every chunk of every file (or, with ``quick``, structure and sizes)."""
        report = VerifyReport(self.path, quick=quick)
        for pe in self.parts:
            self._header(pe)
            # Decoded and checked as load would take it: a checkpoint that verifies
            # does not fail in load on its own content (spec §13).
            check_part(self, pe, verify=not quick)
            for i, f in enumerate(pe.files):
                report.files += 1
                if f.origin is not None:
                    report.shared += 1
                if quick:
                    continue
                # Format 2.0: tensor digests are checked against the values in the same
                # pass (packed values decoded block by block, never held whole).
                check = _DigestCheck(self._fp(f), [t for t in pe.tensors_in(i) if t.digest is not None])
                report.bytes += self.verify_file(f, progress=progress, observe=check.observe if check else None)
                check.finish()
                report.chunks += chunk_count(f.size, f.chunk_size)
        return report

    def iter_tensor_keys(self, part: str | None = None) -> Iterator[str]:
        return (t.key for t in self.part(part).tensors)

    # -- torch-facing conveniences (import torch lazily) -------------------------------
    def tensor(self, key: str, *, part: str | None = None, map_location: Any = None, verify: bool = True) -> Any:
        """Read one tensor lazily: only the chunks it overlaps are read and verified."""
        from ._materialize import read_tensor

        pe, t = self._entry(key, part)
        return read_tensor(self, pe, t, map_location=map_location, verify=verify)

    def state(
        self,
        entry: str | None = None,
        *,
        part: str | None = None,
        map_location: Any = None,
        verify: bool = True,
        mmap: bool | None = None,
    ) -> Any:
        """The saved state of a part as plain trees of fresh tensors: every entry, or one.

        ``state("model")`` is that entry alone, as it was saved: for a module, a plain
        ``state_dict`` with the entry prefix stripped (``{"0.weight": ...}``), ready for
        ``module.load_state_dict(sd, strict=True)``; only its own tensors are read (an
        optimizer in the same file is not). ``state()`` maps every entry name to that.

        Every chunk is verified before anything is returned (unless ``verify=False``).
        Where a file is local, its tensors are backed by a private copy-on-write mapping
        of it, protected by a read lease: no copy and no fresh memory until a tensor is
        written, and a truncation of the file by anyone waits until this process has
        copied the bytes away (spec §11.1), so it never faults the tensors. Where no
        lease can be taken (another user's file, NFS, the first load off the main
        thread), the bytes are read into fresh tensors instead.

        ``mmap=False`` always reads into fresh tensors (resizable storages, nothing
        shared with the page cache). ``mmap=True`` maps even where no lease can be
        taken; then the one caveat is yours: do not truncate the file while the tensors
        live (the process would get SIGBUS).
        """
        from ._materialize import materialize_entry, materialize_state

        if entry is not None and part is None:
            entry, part = self._entry_or_part(entry)
        if part is None and "sharded" in self.meta:  # sharded hook: global tensors (ckpt.dcp)
            from .dcp.full import full_state

            full = full_state(self, verify=verify)
            if entry is None:
                return full
            if entry not in full:
                raise FormatError(f"no entry {entry!r} in this checkpoint (it has {sorted(full)})", path=self.path, key=entry)
            return full[entry]
        pe = self.part(part)
        if entry is None:
            return materialize_state(self, pe, map_location=map_location, verify=verify, mmap=mmap)
        return materialize_entry(self, pe, entry, map_location=map_location, verify=verify, mmap=mmap)

    def _entry_or_part(self, name: str) -> tuple[str | None, str | None]:
        """``state(NAME)`` selects an entry. A part name there is the old signature
        (``state(part)``): still accepted, with a DeprecationWarning."""
        if "sharded" in self.meta or not any(pe.name == name for pe in self.parts):
            return name, None
        if len(self.parts) == 1 and name in self.tree(name)["state"]:
            return name, None  # an entry that happens to share the part's name
        import warnings

        warnings.warn(f"state({name!r}) names a part: use state(part={name!r}); state(NAME) selects an entry",
                      DeprecationWarning, stacklevel=3)
        return None, name


def _holds_ref(obj: Any) -> bool:
    """Whether a decoded value holds a placeholder (tensor, dtype, device), keys included."""
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, (TensorRef, DtypeRef, DeviceRef)):
            return True
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return False


def _not_a_checkpoint(path: str, storage: Any = None) -> CkptError:
    """No MANIFEST (or not a directory): say what the path holds instead (ckpt.probe)."""
    from .probe import FOREIGN_KINDS, probe_path

    found = probe_path(path, storage=storage)
    if found.kind in FOREIGN_KINDS:
        return NotACheckpointError(f"not a checkpoint: {found.describe()}", path=path, kind=found.kind)
    return IncompleteCheckpointError(found.what, path=path)


def open_checkpoint(path: str | os.PathLike[str], *, storage: Storage | None = None) -> CheckpointReader:
    return CheckpointReader(path, storage=storage)
