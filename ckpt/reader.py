"""Reading checkpoints: open (lazy), verify, and load (in place or into fresh tensors).

Opening reads only MANIFEST and a directory listing, and checks structure: names,
sizes, file types, nothing missing and nothing extra. Tensor bytes are read on
demand and every chunk they touch is verified against the digests written at save
time, unless the caller opts out. Every read of a data file (verify, lazy tensors, the
streaming fresh load, both passes of the in-place load) goes through the one range
walker of ``ckpt._ranges``, so verify checks exactly what a load decodes. Nothing in
this module imports torch at import time: ``ckpt inspect`` and ``ckpt verify`` use it
without torch.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ._gc import paused as gc_paused
from ._ranges import ChunkVerifier, RangeWalker, Target, read_tiled
from ._statecheck import check_part
from .dcp.layout import is_sharded
from .errors import (
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
from .format.digest import chunk_count
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
        if not self._storage.strict_listing:
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
        """The MANIFEST entry of one part (a rank's files and tensors); ``name`` may be None only
        when the checkpoint has one part."""
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
            v = ChunkVerifier(self._fp(f), f)
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
        """Every tensor's entry (key, dtype, shape, file, byte span) in one part, in MANIFEST order."""
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

    def _walk(
        self,
        f: FileEntry,
        targets: list[Target],
        *,
        verify: bool,
        handle: ReadHandle | None = None,
        whole: bool = False,
        progress: Callable[[int], None] | None = None,
        pool: Any = None,
    ) -> int:
        """Walk data file ``f`` for ``targets`` (``ckpt._ranges``); returns the bytes read."""
        fp = self._fp(f)
        if handle is not None:
            read = handle.pread_into
        else:
            def read(offset: int, buf: memoryview) -> int:
                return self._storage.pread_into(fp, offset, buf)
        try:
            return RangeWalker(fp, f, read, verify=verify, pool=pool).walk(targets, whole=whole, progress=progress)
        except FileNotFoundError:
            self._raise_if_vanished()
            raise MissingFileError("file named in the manifest is missing", path=fp) from None

    @staticmethod
    def _codec_pool(f: FileEntry) -> Any:
        """The codec threads for a packed file (blocks decode there while the next piece is read)."""
        if f.role != "packed":
            return None
        from .format import bpz  # numpy: only when a packed file is read

        return bpz.shared_pool(knobs().bpz_threads)

    def read_tensor_bytes_into(
        self, pe: PartEntry, t: TensorEntry, dst: memoryview, *, verify: bool = True, handle: ReadHandle | None = None
    ) -> None:
        """Read one tensor's values into ``dst``, verifying every chunk it overlaps.

        ``handle``: read through this open file of the tensor (see :meth:`open_data_file`)
        instead of through the storage by path. Only the chunks the tensor overlaps are
        read (ranged requests on an object store), in pieces of at most 8 MiB beside
        ``dst``; a packed tensor (format 2.0) is decoded into ``dst`` from its span. When
        the chunks fit one piece (the usual case), ``dst`` is written only after every
        chunk has matched; a longer range is copied as it is verified, so after an error
        ``dst`` may hold part of the values.
        """
        self._header(pe, t.file)
        self._walk(pe.files[t.file], [Target(t, dst)], verify=verify, handle=handle)

    def read_tensors_into(
        self, pe: PartEntry, items: list[tuple[TensorEntry, memoryview]], *, verify: bool = True
    ) -> None:
        """Read several tensors of one part into fresh memory, hashing each chunk they
        overlap once: tensors whose chunks touch are read as one run, in file order.

        For fresh destinations only (``state(ENTRY)``, an export): bytes are copied out as
        their piece is read, so after an error a destination may hold part of its bytes.
        Reading tensors one by one would hash a whole chunk for each small tensor in it.
        """
        for index in sorted({t.file for t, _ in items}):  # 2.0: a part's tensors may span files
            self._header(pe, index)
            f = pe.files[index]
            targets = [Target(t, dst) for t, dst in items if t.file == index]
            self._walk(f, targets, verify=verify, pool=self._codec_pool(f))

    def check_file(
        self,
        pe: PartEntry,
        index: int,
        keys: set[str] | None = None,
        *,
        verify: bool = True,
        handle: ReadHandle | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Read data file ``index`` as a load of its tensors (those named in ``keys``;
        every one, and every chunk of the file, when None) reads it, keeping nothing:
        every chunk they overlap hashed (``verify``), every packed span decoded under
        every rule of format-2.md §V.3.3, every recorded tensor digest compared. Returns
        the bytes read.

        ``verify`` runs it on every data file, and an in-place load (pass 1) on every file
        it will read into a target, before it writes any: one walker, so a checkpoint
        that verifies decodes in the load, and a load that would fail on a span fails
        before any target changed. Without ``verify`` plain bytes need no read (nothing
        to check but sizes) and packed spans are still decoded.
        """
        f = pe.files[index]
        self._header(pe, index)
        if not verify and f.role != "packed":
            return 0
        targets = [Target(t) for t in pe.tensors_in(index) if keys is None or t.key in keys]
        return self._walk(
            f, targets, verify=verify, handle=handle, whole=verify and keys is None, progress=progress,
            pool=self._codec_pool(f),
        )

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
        the destinations and hashed there (``ckpt._ranges.read_tiled``): one read and one
        hash pass, no scratch copy, and since tensors tile the data region (checked
        against the safetensors header) every byte of the file is verified. A shared file
        (format 2.0, which may hold tensors this checkpoint does not reference) and a
        packed file go through the range walker, in one pass over the file: each piece is
        hashed, then decoded on the codec threads while the next one is read.
        ``handle``: read through this open file (from :meth:`open_data_file`; the caller
        closes it).
        """
        f = pe.files[index]
        entries = pe.tensors_in(index)
        fp = self._fp(f)
        own = handle is None
        if handle is None:
            handle = self.open_data_file(pe, index)
        else:
            self._header(pe, index)
        try:
            if f.role == "packed" or f.origin is not None:
                targets = [Target(t, destinations(t)) for t in entries]
                self._walk(f, targets, verify=verify, handle=handle, pool=self._codec_pool(f))
                return
            n, _ = self._headers[(pe.name, index)]
            read_tiled(fp, f, handle, n, entries, destinations, verify=verify, request=knobs().read_request)
        finally:
            if own:
                handle.close()

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
        v = ChunkVerifier(self._fp(f), f, first=first)
        v.update(data)
        v.finish()

    def verify_file(
        self,
        f: FileEntry,
        *,
        handle: ReadHandle | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Re-hash every chunk of file ``f`` in bounded pieces; returns the bytes hashed.
        (A data file's tensors are checked with :meth:`check_file`, which hashes too.)"""
        return self._walk(f, [], verify=True, handle=handle, whole=True, progress=progress)

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
                if f.role in ("tensors", "packed"):
                    # What a load reads, read the same way (ckpt._ranges): every packed span
                    # decoded, every recorded tensor digest compared, in the hashing pass.
                    report.bytes += self.check_file(pe, i, progress=progress)
                else:
                    report.bytes += self.verify_file(f, progress=progress)
                report.chunks += chunk_count(f.size, f.chunk_size)
        return report

    def iter_tensor_keys(self, part: str | None = None) -> Iterator[str]:
        """The tensor keys of one part (``model/0.weight``), in MANIFEST order; reads nothing."""
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
        unsafe_mmap: bool = False,
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

        The lease also covers an in-place overwrite: opening the file for writing breaks
        it the same way, so the tensors keep the verified bytes.

        Process-wide effect: the lease's breaks arrive as a signal, whose handler the
        first mapped load installs (on the main thread only). Install it yourself at
        start-up with ``ckpt.storage.install_lease_handler()``, or set
        ``CKPT_LEASE_HANDLER=off`` to keep any load from installing it (loads then read
        into fresh memory unless you installed it); ``mmap=False`` never installs it.

        ``mmap=False`` always reads into fresh tensors (resizable storages, nothing
        shared with the page cache). ``mmap=True`` insists on the protected mapping: where
        no lease can be taken it raises ``UnprotectedMappingError`` instead of reading.
        ``unsafe_mmap=True`` maps even where no lease can be taken; then the caveats are
        yours: a write into the file in place changes the returned tensors silently, and
        a truncation kills the process (SIGBUS) at its next access to them.
        """
        from ._materialize import check_mmap_options, materialize_entry, materialize_state

        check_mmap_options(mmap, unsafe_mmap)
        if entry is not None and part is None:
            entry, part = self._entry_or_part(entry)
        if part is None and is_sharded(self.manifest):  # sharded hook: global tensors (ckpt.dcp)
            from .dcp.full import full_state

            full = full_state(self, verify=verify)
            if entry is None:
                return full
            if entry not in full:
                raise FormatError(f"no entry {entry!r} in this checkpoint (it has {sorted(full)})", path=self.path, key=entry)
            return full[entry]
        pe = self.part(part)
        if entry is None:
            return materialize_state(self, pe, map_location=map_location, verify=verify, mmap=mmap, unsafe_mmap=unsafe_mmap)
        return materialize_entry(self, pe, entry, map_location=map_location, verify=verify, mmap=mmap, unsafe_mmap=unsafe_mmap)

    def _entry_or_part(self, name: str) -> tuple[str | None, str | None]:
        """``state(NAME)`` selects an entry. A part name there is the old signature
        (``state(part)``): still accepted, with a DeprecationWarning."""
        if is_sharded(self.manifest) or not any(pe.name == name for pe in self.parts):
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
