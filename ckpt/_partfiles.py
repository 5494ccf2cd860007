"""Which file each tensor of a part goes to, for format 2.0 saves (spec/format-2.md).

A 1.0 save puts every tensor in ``<part>.safetensors``. With ``compress`` the tensors the
policy picks are encoded (BPZ1 byte planes + zstd, ``format/bpz.py``) into the packed file
``<part>.bpz``. With dedup (``reuse``: the same part of the previous checkpoint of the run)
every tensor is hashed; files of the previous checkpoint whose referenced tensors are all
unchanged are shared by hard link instead of written (§V.4), and only the rest is written,
into files named after their content so that names never collide with shared ones.

The writer keeps the safetensors loop (``writer.write_part``); this module plans, writes
the packed file and makes the links.
"""

from __future__ import annotations

import os
import stat
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from .format import bpz, dtypes
from .format.codec import packb
from .format.digest import digest_bytes
from .format.manifest import FileEntry, PartEntry, TensorEntry
from ._linkcheck import SharedFileDamagedWarning, check_linked
from ._tensorbytes import tensor_memoryview
from .errors import CkptError
from .knobs import knobs
from .save_options import Compress
from .storage import Storage

__all__ = ["Compress", "Reuse", "Layout", "plan", "write_packed", "link_shared", "compress_policy", "reuse_from"]


_FLOATS = frozenset(("float16", "bfloat16", "float32", "float64"))


@dataclass(frozen=True, slots=True)
class Reuse:
    """The same part of the previous checkpoint of this run: where a save may share files
    from (spec/format-2.md §V.4.2). ``directory`` is that checkpoint's directory."""

    directory: str
    part: PartEntry


def compress_policy(compress: Compress) -> Callable[[str, str, str, int], bool]:
    """``(top-level entry, key, dtype name, nbytes) -> encode?``"""
    if not compress:
        return lambda top, key, dt, n: False
    floor = knobs().compress_min_bytes
    if compress is True:
        return lambda top, key, dt, n: dt in _FLOATS and n >= floor
    if callable(compress):
        fn = compress
        return lambda top, key, dt, n: n > 0 and bool(fn(key, dt, n))
    if isinstance(compress, str):
        raise TypeError("compress= takes True, a list of top-level entry names or a callable, not a str")
    names = frozenset(compress)
    return lambda top, key, dt, n: top in names and dt in _FLOATS and n >= floor


@dataclass(slots=True)
class Shared:
    """A file of the reuse source that this part links instead of writing."""

    entry: FileEntry  # as the source MANIFEST has it
    tensors: list[TensorEntry]  # the source's entries this part references in it
    source: str  # path of the file in the source checkpoint


@dataclass(slots=True)
class Layout:
    plain: list[tuple[str, Any]] = field(default_factory=list)  # -> the part's safetensors file
    packed: list[tuple[str, Any]] = field(default_factory=list)  # -> the part's packed file
    shared: list[Shared] = field(default_factory=list)
    digests: dict[str, bytes] = field(default_factory=dict)  # tensor key -> xxh3-128 of its values
    plain_name: str = ""
    packed_name: str = ""
    dedup: bool = False
    tensors: dict[str, Any] = field(default_factory=dict)  # key -> tensor (to write a file that fails to link)
    encode: dict[str, bool] = field(default_factory=dict)

    @property
    def v2(self) -> bool:
        return bool(self.packed or self.shared or self.digests)


def _values(t: Any) -> memoryview:
    return tensor_memoryview(t)


def _hash_all(tensors: Sequence[tuple[str, Any]]) -> dict[str, bytes]:
    # xxh3 releases the GIL: two threads hash two tensors at once.
    if len(tensors) > 1 and sum(t.numel() * t.element_size() for _, t in tensors) >= 8 << 20:
        with ThreadPoolExecutor(2) as pool:
            return dict(zip((k for k, _ in tensors), pool.map(lambda kt: digest_bytes(_values(kt[1])), tensors)))
    return {k: digest_bytes(_values(t)) for k, t in tensors}


def _content_name(part: str, rows: Iterable[list[Any]], suffix: str, taken: set[str],
                  file_name: Callable[[str, str], str]) -> str:
    h = digest_bytes(packb(list(rows)))[:8].hex()
    name = file_name(part, f"-{h}{suffix}")
    n = 0
    while name in taken:  # a 2^-64 accident; still never reuse a name in one checkpoint
        n += 1
        name = file_name(part, f"-{h}~{n}{suffix}")
    return name


def plan(
    part: str,
    tensors: Sequence[tuple[str, Any]],
    tops: Mapping[str, str],
    *,
    compress: Compress = None,
    reuse: Reuse | None = None,
    dedup: bool = False,
    storage: Storage | None = None,
    file_name: Callable[[str, str], str] | None = None,
) -> Layout:
    """Decide where every tensor goes. ``dedup``: hash every tensor (so a later save can
    share this one's files) even when there is nothing to reuse yet."""
    policy = compress_policy(compress)
    dedup = dedup or reuse is not None
    out = Layout(dedup=dedup, tensors=dict(tensors))
    if dedup and tensors:
        out.digests = _hash_all(tensors)
    encode = out.encode = {k: policy(tops.get(k, ""), k, dtypes.dtype_name(t.dtype), t.numel() * t.element_size()) for k, t in tensors}
    reused: set[str] = set()
    if reuse is not None:
        out.shared = _shareable(reuse, tensors, out.digests, encode, storage)
        reused = {e.key for s in out.shared for e in s.tensors}
    for k, t in tensors:
        if k not in reused:
            (out.packed if encode[k] else out.plain).append((k, t))
    _name_files(part, out, file_name or _plain_name)
    return out


def _plain_name(part: str, suffix: str) -> str:
    return f"{part}{suffix}"


def _name_files(part: str, out: Layout, file_name: Callable[[str, str], str], taken: Iterable[str] = ()) -> None:
    """``file_name(part, suffix)``: the save's naming (``PendingCheckpoint.file_name``: an
    object store adds a per-save tag). ``taken``: names already used in the temporary
    directory besides the shared files."""
    if not out.dedup:
        out.plain_name, out.packed_name = file_name(part, ".safetensors"), file_name(part, ".bpz")
        return
    taken = {s.entry.name for s in out.shared} | set(taken)

    def rows(ts: list[tuple[str, Any]], enc: str | None) -> Iterable[list[Any]]:
        return ([k, dtypes.dtype_name(t.dtype), list(t.shape), out.digests[k], enc] for k, t in ts)

    out.plain_name = _content_name(part, rows(out.plain, None), ".safetensors", taken, file_name)
    taken.add(out.plain_name)
    out.packed_name = _content_name(part, rows(out.packed, bpz.NAME), ".bpz", taken, file_name)


def _shareable(
    reuse: Reuse,
    tensors: Sequence[tuple[str, Any]],
    digests: Mapping[str, bytes],
    encode: Mapping[str, bool],
    storage: Storage | None,
) -> list[Shared]:
    """The source's files every referenced tensor of which is unchanged (§V.4.2 rule 2),
    holding at least half their size in tensors this save references (§V.4.3 space)."""
    prev = {t.key: t for t in reuse.part.tensors}
    by_file: dict[int, list[TensorEntry]] = {}
    for k, t in tensors:
        e = prev.get(k)
        if (
            e is None
            or e.digest is None
            or e.digest != digests[k]
            or e.dtype != dtypes.dtype_name(t.dtype)
            or e.shape != tuple(t.shape)
            or (e.encoding is not None) != encode[k]
        ):
            continue
        by_file.setdefault(e.file, []).append(e)
    out = []
    for idx, mine in sorted(by_file.items()):
        f = reuse.part.files[idx]
        if f.role not in ("tensors", "packed"):
            continue
        if 2 * sum(e.stored_nbytes for e in mine) < f.size:
            continue  # mostly stale: write these tensors again rather than keep the rest alive
        src = os.path.join(reuse.directory, f.name)
        try:
            st = os.lstat(src) if storage is None else storage.lstat(src)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
            what = f"is {st.st_size} bytes" if stat.S_ISREG(st.st_mode) else "is not a regular file"
            _warn_damaged(src, f"{what}, the MANIFEST declares {f.size}")
            continue
        out.append(Shared(f, mine, src))
    return out[:60]  # files per part stay within the limit of 64 (§V.7)


def link_shared(
    part: str, layout: Layout, tmp_dir: str, storage: Storage, *, file_name: Callable[[str, str], str] | None = None
) -> list[tuple[FileEntry, list[TensorEntry]]]:
    """Link the planned shared files into the temporary directory (§V.4.2 rule 3), before
    anything else is written, and check each one linked (§V.4.6, ``_linkcheck``). A file
    that cannot be linked (another filesystem, the link limit, a backend without links or
    server-side copy, the source gone), or whose bytes are not what its MANIFEST declares,
    is written instead from the tensors in memory: its tensors go back to
    ``layout.plain``/``layout.packed``, and the new files are named after their final
    content. A damaged one is reported (``SharedFileDamagedWarning``) and its link removed at
    once; the new files avoid its name, and a link that could not be removed, unnamed by the
    MANIFEST, is dropped by a filesystem's commit and ignored by an object store's readers."""
    done: list[tuple[FileEntry, list[TensorEntry]]] = []
    keep: list[Shared] = []
    damaged: list[str] = []
    # §V.4.2 rule 1: only from a checkpoint of the same run directory; a backend that cannot
    # link (Storage.link False) writes the bytes (§V.4.5)
    same_run = not layout.shared or _parent(_parent(layout.shared[0].source)) == _parent(tmp_dir)
    for s in layout.shared:
        dst = os.path.join(tmp_dir, s.entry.name)
        if same_run and storage.link(s.source, dst):
            # Checked where it now stands: the bytes checked are the bytes committed.
            why = check_linked(storage, dst, s.entry)
            if why is None:
                keep.append(s)
                origin = s.entry.origin or os.path.basename(os.path.dirname(s.source))
                done.append((FileEntry(s.entry.name, s.entry.role, s.entry.size, s.entry.chunk_size, s.entry.digests,
                                       None, None, origin), s.tensors))
                continue
            damaged.append(s.entry.name)
            _warn_damaged(s.source, why)
            try:  # the damaged bytes under a name: on an object store, where readers ignore
                storage.remove_file(dst)  # unnamed objects, it would make this checkpoint
            except OSError:               # look damaged to retention
                pass  # left unnamed: the commit drops it, or readers ignore it
        for e in s.tensors:
            (layout.packed if layout.encode[e.key] else layout.plain).append((e.key, layout.tensors[e.key]))
    if len(keep) != len(layout.shared):
        layout.shared = keep
        _name_files(part, layout, file_name or _plain_name, damaged)
    return done


def _warn_damaged(source: str, why: str) -> None:
    warnings.warn(
        f"shared file {source} {why}: not shared; this save writes its tensors again from memory. "
        f"Every checkpoint that links this file fails verify (spec/format-2.md §V.4.6)",
        SharedFileDamagedWarning, stacklevel=2)


def _parent(path: str) -> str:
    """The directory holding ``path`` (a local path or an object-store URL)."""
    return path.rstrip("/").rsplit("/", 1)[0]


def write_packed(
    layout: Layout, tmp_dir: str, storage: Storage
) -> tuple[FileEntry, list[TensorEntry]] | None:
    """Write ``layout.packed`` as one packed file of BPZ1 spans, encoding on a thread pool
    while the bytes of earlier blocks are written and hashed."""
    if not layout.packed:
        return None
    k = knobs()
    name = layout.packed_name
    entries: list[TensorEntry] = []
    sink = storage.create(os.path.join(tmp_dir, name), k.chunk_size)
    pos = 0
    try:
        starts: list[int] = []
        # Each piece is consumed before write_copy returns (FileSink), so the encoder
        # recycles its block buffers.
        put = sink.write_copy
        # One pipeline over every tensor's blocks: small tensors overlap too.
        items = [(_values(t), t.element_size()) for _, t in layout.packed]
        for i, pieces in bpz.encode_many(items, block=k.bpz_block, pool=bpz.shared_pool(k.bpz_threads), reuse=True):
            if i == len(starts):
                starts.append(pos)
            for b in pieces:
                put(b)
                pos += len(b)
        starts.append(pos)
        for (key, t), lo, hi in zip(layout.packed, starts, starts[1:]):
            nbytes = t.numel() * t.element_size()
            entries.append(TensorEntry(key, dtypes.dtype_name(t.dtype), tuple(t.shape), -1, lo, nbytes,
                                       layout.digests.get(key), bpz.NAME, hi - lo))
        size, digests = sink.close()
    except BaseException:
        sink.discard()
        raise
    return FileEntry(name, "packed", size, k.chunk_size, digests), entries


def reuse_from(path: str | os.PathLike[str], part: str, *, storage: Storage | None = None) -> Reuse | None:
    """The part ``part`` of the committed checkpoint at ``path``, as a dedup source; None
    when there is none to share from (not committed, no such part, unreadable): the save
    then writes everything, which is always correct.

    Reads the MANIFEST and this part's own detail only (one part manifest), not the whole
    checkpoint: every rank of a large job asks for its own part; the files to share are
    checked one by one before they are linked (:func:`_shareable`)."""
    from .format.manifest import PartRef, decode_part_manifest
    from .storage import read_manifest, resolve

    try:
        storage, root = resolve(path, storage)
        m, _ = read_manifest(storage, root)
        if part not in m.parts.names:
            return None
        entry = m.parts.listed()[m.parts.index(part)]
        if isinstance(entry, PartRef):
            ppath = os.path.join(root, entry.manifest)
            entry = decode_part_manifest(storage.read(ppath, 0, entry.manifest_size), entry, m.version, path=ppath)
        return Reuse(root, entry)
    except (CkptError, OSError):
        return None
