"""MANIFEST: the commit record of a checkpoint (spec/checkpoint-format.md §3).

Binary layout, little-endian::

    offset  size  type    field
    0       8     bytes   magic  b"CKPTMNFT"
    8       2     u16     major version (1)
    10      2     u16     minor version (0)
    12      4     u32     flags, reserved, MUST be 0
    16      8     u64     body length L (<= 64 MiB)
    24      L     bytes   body: a msgpack map (schema below)
    24+L    16    bytes   xxh3-128 of bytes [0, 24+L)

The body is validated field by field: a reader accepts exactly the documented schema
(unknown keys are ignored, so a minor version may add fields; every known field is
checked for type and range), so a hostile manifest cannot smuggle a path, a size or a digest list that the writer could not have made.

Major 2 (spec/format-2.md) has 8-element file entries (``origin``: a file shared from an
earlier checkpoint) and tensor entries (``digest``, ``encoding``: packed BPZ1 spans), and
part references: a part whose detail lives in a part manifest file (magic ``CKPTPART``,
same framing), read on first use through the loader a reader binds to ``Manifest.parts``.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..errors import FormatError, LimitExceededError, UnsafePathError, UnsupportedVersionError
from ..knobs import knobs
from . import dtypes
from .codec import packb, unpackb
from .digest import DIGEST_SIZE, chunk_count, digest_bytes

__all__ = [
    "TMP_PREFIX",
    "MAGIC",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "FileEntry",
    "TensorEntry",
    "PartEntry",
    "Manifest",
    "encode_manifest",
    "decode_manifest",
    "check_name",
    "MANIFEST_NAME",
    "PART_MAGIC",
    "PartRef",
    "PartList",
    "encode_part_manifest",
    "decode_part_manifest",
    "uses_v2",
    "part_record",
]

MAGIC = b"CKPTMNFT"
PART_MAGIC = b"CKPTPART"
#: the newest major this reader implements; it reads every major in MAJORS
FORMAT_MAJOR = 2
FORMAT_MINOR = 0
MAJORS = (1, 2)
#: what a writer writes unless the save uses a 2.0 feature (spec §13: the lowest version)
V1 = (1, 0)
V2 = (2, 0)
MANIFEST_NAME = "MANIFEST"
TMP_PREFIX = ".tmp-"
"""The name prefix of a directory being written or deleted (spec §3): never a checkpoint; readers and listings skip it."""
_HEADER = struct.Struct("<8sHHIQ")
HEADER_SIZE = _HEADER.size  # 24

# Used with fullmatch only: with match() "$" also matches before a trailing newline,
# so "step-1\n" passed.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
ROLES = ("tensors", "state")
ROLES_V2 = ("tensors", "state", "packed")
CODECS = (None, "zstd")
ENCODINGS = ("bpz1",)
#: no honest zstd frame expands more (format-2.md §V.3.3); keep in step with format/bpz.py
MAX_EXPANSION = 32768
KINDS = ("checkpoint", "snapshot")


def check_name(name: Any, *, what: str, path: str | None = None) -> str:
    """A file or part name: one path component, no traversal, no hidden files."""
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None or ".." in name or name == MANIFEST_NAME:
        raise UnsafePathError(f"unsafe or invalid {what} name {name!r}", path=path, key=str(name)[:80])
    return name


@dataclass(frozen=True, slots=True)
class FileEntry:
    name: str
    role: str  # "tensors" (a safetensors file), "state" (msgpack, maybe zstd), "packed" (BPZ1 spans, 2.0)
    size: int
    chunk_size: int
    digests: bytes  # DIGEST_SIZE bytes per chunk, concatenated
    codec: str | None = None
    raw_size: int | None = None
    #: 2.0: the checkpoint directory whose save wrote this file, when this one shares it
    origin: str | None = None

    def to_wire(self, major: int = 1) -> list[Any]:
        out = [self.name, self.role, self.size, self.chunk_size, self.digests, self.codec, self.raw_size]
        return out if major == 1 else [*out, self.origin]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    file: int  # index into the part's files
    offset: int  # absolute byte offset in that file
    nbytes: int  # bytes of the values (product(shape) * itemsize), whatever the encoding
    #: 2.0: xxh3-128 of the values (set under dedup), and the BPZ1 span's length when packed
    digest: bytes | None = None
    encoding: str | None = None
    stored: int | None = None

    @property
    def stored_nbytes(self) -> int:
        """Bytes the tensor occupies in its file (its span)."""
        return self.nbytes if self.encoding is None else int(self.stored or 0)

    def to_wire(self, major: int = 1) -> list[Any]:
        out = [self.key, self.dtype, list(self.shape), self.file, self.offset, self.nbytes]
        if major == 1:
            return out
        return [*out, self.digest, None if self.encoding is None else [self.encoding, self.stored]]


@dataclass(frozen=True, slots=True)
class PartEntry:
    name: str
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    summary: dict[str, Any] = field(default_factory=dict)

    def file(self, role: str) -> FileEntry | None:
        for f in self.files:
            if f.role == role:
                return f
        return None

    def data_files(self) -> list[int]:
        """Indices of the files that hold tensor bytes (safetensors and packed), in order."""
        return [i for i, f in enumerate(self.files) if f.role in ("tensors", "packed")]

    def tensors_in(self, index: int) -> list[TensorEntry]:
        return [t for t in self.tensors if t.file == index]

    def to_dict(self) -> dict[str, Any]:
        """msgpack-able form, to send a part record from a writer process to the committer."""
        return self.to_wire(2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PartEntry":
        # Trusted input from our own writer processes; the committed MANIFEST is
        # validated in full by every reader anyway.
        def tensor(t: list[Any]) -> TensorEntry:
            enc = t[7] if len(t) > 7 else None
            return TensorEntry(t[0], t[1], tuple(t[2]), t[3], t[4], t[5], t[6] if len(t) > 6 else None,
                               None if enc is None else enc[0], None if enc is None else enc[1])

        return cls(
            d["name"],
            tuple(FileEntry(*f) for f in d["files"]),
            tuple(tensor(t) for t in d["tensors"]),
            dict(d["summary"]),
        )

    def to_wire(self, major: int = 1) -> dict[str, Any]:
        return {
            "name": self.name,
            "files": [f.to_wire(major) for f in self.files],
            "tensors": [t.to_wire(major) for t in self.tensors],
            "summary": self.summary,
        }

    def uses_v2(self) -> bool:
        return (
            any(f.origin is not None or f.role == "packed" for f in self.files)
            or sum(f.role == "tensors" for f in self.files) > 1
            or any(t.encoding is not None or t.digest is not None for t in self.tensors)
        )


@dataclass(frozen=True, slots=True)
class PartRef:
    """A part listed by reference (format 2.0 §V.5.2): its detail is in a part manifest."""

    name: str
    manifest: str  # the part manifest's file name
    manifest_size: int
    manifest_digest: bytes  # xxh3-128 of the whole part manifest file
    sizes: tuple[tuple[str, int], ...]  # (name, size) of each of the part's files

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "manifest": [self.manifest, self.manifest_size, self.manifest_digest],
            "sizes": [[n, z] for n, z in self.sizes],
        }

    def to_dict(self) -> dict[str, Any]:
        return {"ref": self.to_wire()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PartRef":
        w = d["ref"]
        m = w["manifest"]
        return cls(w["name"], m[0], m[1], m[2], tuple((n, z) for n, z in w["sizes"]))


class PartList(Sequence[PartEntry]):
    """The parts of a MANIFEST, in order. Inline parts are held; a part reference is read
    (its part manifest decoded and checked against the reference) on first access, by
    the loader a reader binds. Counting parts, naming them and listing their files'
    names and sizes never reads a part manifest."""

    __slots__ = ("_items", "_loader", "_refs", "_index")

    def __init__(self, items: Sequence[PartEntry | PartRef] = (), loader: Callable[[PartRef], PartEntry] | None = None) -> None:
        self._items: list[PartEntry | PartRef] = list(items)
        self._loader = loader
        self._refs = tuple(x for x in self._items if isinstance(x, PartRef))
        self._index = {x.name: i for i, x in enumerate(self._items)}  # a lookup per part must not scan N parts

    def bind(self, loader: Callable[[PartRef], PartEntry]) -> None:
        self._loader = loader

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        item = self._items[i]
        if isinstance(item, PartRef):
            if self._loader is None:
                raise KeyError(f"part {item.name!r} is a reference to {item.manifest!r}: open the checkpoint to read it")
            loaded = self._loader(item)
            self._items[i] = loaded
            return loaded
        return item

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (PartList, tuple, list)) and list(self.entries()) == list(
            other.entries() if isinstance(other, PartList) else other
        )

    def __hash__(self) -> int:  # pragma: no cover - a Manifest is never hashed
        return id(self)

    def __repr__(self) -> str:
        return f"PartList({len(self)} parts, {self.refs} by reference)"

    def entries(self) -> tuple[PartEntry | PartRef, ...]:
        """Inline parts and unread references, as held (reads nothing)."""
        return tuple(self._items)

    def listed(self) -> tuple[PartEntry | PartRef, ...]:
        """Each part as the MANIFEST lists it: inline, or its reference (read or not)."""
        refs = {r.name: r for r in self._refs}
        return tuple(refs.get(x.name, x) for x in self._items)

    @property
    def refs(self) -> int:
        """How many parts the MANIFEST lists by reference (read since or not)."""
        return len(self._refs)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(x.name for x in self._items)

    def index(self, name: str, *args: Any) -> int:  # type: ignore[override]
        try:
            return self._index[name]
        except KeyError:
            raise ValueError(name) from None

    def file_sizes(self) -> list[tuple[str, int, bool]]:
        """(name, size, is a part manifest) of every file of every part, reading nothing."""
        out: list[tuple[str, int, bool]] = []
        for x in self.listed():
            if isinstance(x, PartRef):
                out.append((x.manifest, x.manifest_size, True))
                out.extend((n, z, False) for n, z in x.sizes)
            else:
                out.extend((f.name, f.size, False) for f in x.files)
        return out


@dataclass(frozen=True, slots=True)
class Manifest:
    id: str
    kind: str
    step: int | None
    created_at: float  # volatile: the only field two saves of the same state may differ in
    package_version: str
    parts: PartList  # tuples and lists are wrapped
    meta: dict[str, Any] = field(default_factory=dict)
    version: tuple[int, int] = V1

    def __post_init__(self) -> None:
        if not isinstance(self.parts, PartList):
            object.__setattr__(self, "parts", PartList(self.parts))

    def part(self, name: str | None = None) -> PartEntry:
        if name is None:
            if len(self.parts) == 1:
                return self.parts[0]
            raise KeyError(f"checkpoint has {len(self.parts)} parts; name one of {list(self.parts.names)[:8]}")
        try:
            return self.parts[self.parts.index(name)]
        except ValueError:
            raise KeyError(f"no part {name!r}; parts are {list(self.parts.names)[:8]}") from None

    @property
    def files(self) -> list[FileEntry]:
        """Every file entry of every part (reads every part manifest)."""
        return [f for p in self.parts for f in p.files]

    @property
    def total_bytes(self) -> int:
        return sum(z for _, z, _ in self.parts.file_sizes())


def part_record(d: dict[str, Any]) -> PartEntry | PartRef:
    """A part record in its ``to_dict()`` form (sent by a writer process) back as an object."""
    return PartRef.from_dict(d) if "ref" in d else PartEntry.from_dict(d)


def uses_v2(parts: Sequence[PartEntry | PartRef]) -> bool:
    """Whether a checkpoint of these parts needs format 2.0 (else it is written as 1.0)."""
    return any(isinstance(p, PartRef) or p.uses_v2() for p in parts)


def content_id(parts: Sequence[PartEntry | PartRef] | PartList) -> str:
    """Deterministic id: a digest over every file's name, size and chunk digests (an
    unread part reference contributes its part manifest's name, size and digest)."""
    items = parts.listed() if isinstance(parts, PartList) else parts
    ids = []
    for p in items:
        if isinstance(p, PartRef):
            ids.append([p.name, [[p.manifest, p.manifest_size, p.manifest_digest]]])
        else:
            ids.append([p.name, [[f.name, f.size, f.digests] for f in p.files]])
    return digest_bytes(packb(ids)).hex()


def _frame(magic: bytes, version: tuple[int, int], body: bytes) -> bytes:
    if len(body) > knobs().max_manifest_bytes:
        raise LimitExceededError(f"manifest body of {len(body)} bytes exceeds the limit {knobs().max_manifest_bytes}")
    head = _HEADER.pack(magic, version[0], version[1], 0, len(body))
    return head + body + digest_bytes(head + body)


def check_depth(doc: Any, *, path: str | None = None, what: str = "manifest body") -> None:
    """A MANIFEST or part manifest nests at most ``Knobs.max_nesting`` containers below its
    body (spec §4.2): ``meta`` and ``summary`` are free-form, and a reader walking them
    (inspect, --json) must not recurse without bound. Iterative, like the walk it guards."""
    limit = knobs().max_nesting
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        v, d = stack.pop()
        t = type(v)
        if t is dict or t is list:
            if d > limit:
                raise LimitExceededError(f"{what} nests deeper than {limit} containers", path=path, offset=HEADER_SIZE)
            stack.extend((x, d + 1) for x in (v.values() if t is dict else v))


def encode_manifest(m: Manifest) -> bytes:
    major = m.version[0]
    items = m.parts.listed()
    if major == 1 and uses_v2(items):
        raise ValueError("these parts use format 2.0 features; the manifest must be version 2")
    doc = {
        "format": "ckpt-replay/checkpoint",
        "id": m.id,
        "kind": m.kind,
        "step": m.step,
        "created_at": m.created_at,
        "package_version": m.package_version,
        "parts": [p.to_wire() if isinstance(p, PartRef) else p.to_wire(major) for p in items],
        "meta": m.meta,
    }
    check_depth(doc)  # a writer never writes what its readers refuse (a deep meta or summary)
    return _frame(MAGIC, m.version, packb(doc))


def encode_part_manifest(part: PartEntry, version: tuple[int, int] = V2) -> bytes:
    """A part manifest file (format-2.md §V.5.1)."""
    doc = {"format": "ckpt-replay/part", "part": part.to_wire(version[0])}
    check_depth(doc, what="part manifest body")
    return _frame(PART_MAGIC, version, packb(doc))


# --- decoding ------------------------------------------------------------------------


def _need(cond: bool, msg: str, path: str | None, key: str | None = None) -> None:
    if not cond:
        raise FormatError(f"invalid manifest: {msg}", path=path, key=key)


def _int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _unframe(data: bytes, magic_want: bytes, what: str, path: str | None) -> tuple[tuple[int, int], Any]:
    """Check a MANIFEST-style frame in the order of spec §4.1; return (version, decoded body)."""
    k = knobs()
    if len(data) < HEADER_SIZE + DIGEST_SIZE:
        raise FormatError(f"{what} is {len(data)} bytes, shorter than its fixed header", path=path, offset=len(data))
    magic, major, minor, flags, body_len = _HEADER.unpack_from(data, 0)
    if magic != magic_want:
        raise FormatError(f"bad magic {magic!r}, expected {magic_want!r}", path=path, offset=0)
    if major not in MAJORS:
        raise UnsupportedVersionError(
            f"format version {major}.{minor} is not supported by this reader (majors {', '.join(map(str, MAJORS))})",
            path=path,
            offset=8,
        )
    if flags != 0:
        raise FormatError(f"reserved flags are {flags:#x}, must be 0", path=path, offset=12)
    if body_len > k.max_manifest_bytes:
        raise LimitExceededError(
            f"{what} declares a {body_len}-byte body, above the limit {k.max_manifest_bytes}", path=path, offset=16
        )
    expected = HEADER_SIZE + body_len + DIGEST_SIZE
    if len(data) != expected:
        raise FormatError(
            f"{what} is {len(data)} bytes, header says {expected}", path=path, offset=min(len(data), expected)
        )
    end = HEADER_SIZE + body_len
    if digest_bytes(data[:end]) != data[end:]:
        from ..errors import ChecksumMismatchError

        raise ChecksumMismatchError(f"{what} digest does not match its bytes", path=path, offset=end)
    body = unpackb(memoryview(data)[HEADER_SIZE:end], path=path, what=f"{what} body", offset=HEADER_SIZE)
    check_depth(body, path=path, what=f"{what} body")
    return (major, minor), body


def decode_manifest(data: bytes, *, path: str | None = None) -> Manifest:
    version, body = _unframe(data, MAGIC, "manifest", path)
    m = _validate(body, version, path)
    if content_id(m.parts) != m.id:
        # Spec §5.2: readers MUST recompute the id. The manifest digest covers the id,
        # so this only trips on a writer bug or a hand-edited manifest that was re-signed.
        from ..errors import ChecksumMismatchError

        raise ChecksumMismatchError("manifest id does not match the digest of its parts", path=path, key="id")
    return m


def decode_part_manifest(data: bytes, ref: PartRef, version: tuple[int, int], *, path: str | None = None) -> PartEntry:
    """A part manifest read for ``ref`` (format-2.md §V.5): digest and size against the
    reference, same version as the MANIFEST, and the part it holds agrees with ``sizes``."""
    from ..errors import ChecksumMismatchError

    if len(data) != ref.manifest_size:
        raise FormatError(f"part manifest is {len(data)} bytes, the MANIFEST says {ref.manifest_size}", path=path,
                          offset=min(len(data), ref.manifest_size))
    if digest_bytes(data) != ref.manifest_digest:
        raise ChecksumMismatchError("part manifest does not match the digest its reference gives", path=path,
                                    key=f"part {ref.name}")
    got, body = _unframe(data, PART_MAGIC, "part manifest", path)
    _need(got == version, f"part manifest is version {got[0]}.{got[1]}, its MANIFEST {version[0]}.{version[1]}", path, "version")
    _need(isinstance(body, dict) and body.get("format") == "ckpt-replay/part", "format tag is missing or wrong", path, "format")
    rp = body.get("part")
    pe = _validate_part(rp, 2, path, "part", set(), set())
    _need(pe.name == ref.name, f"part manifest holds part {pe.name!r}, its reference names {ref.name!r}", path, "part.name")
    _need(tuple((f.name, f.size) for f in pe.files) == ref.sizes,
          "the part's files disagree with the names and sizes its reference gives", path, "part.files")
    return pe


def _validate(body: Any, version: tuple[int, int], path: str | None) -> Manifest:
    major = version[0]
    _need(isinstance(body, dict), "body is not a map", path)
    _need(body.get("format") == "ckpt-replay/checkpoint", "format tag is missing or wrong", path, "format")
    cid = body.get("id")
    _need(isinstance(cid, str) and re.fullmatch(r"[0-9a-f]{32}", cid) is not None, "bad id", path, "id")
    kind = body.get("kind")
    _need(kind in KINDS, f"unknown kind {kind!r}", path, "kind")
    step = body.get("step")
    _need(step is None or _int(step, 0, 2**63 - 1), "step must be a non-negative int or nil", path, "step")
    created = body.get("created_at")
    _need(isinstance(created, float), "created_at must be a float", path, "created_at")
    pv = body.get("package_version")
    _need(isinstance(pv, str) and len(pv) < 64, "bad package_version", path, "package_version")
    meta = body.get("meta")
    _need(isinstance(meta, dict), "meta must be a map", path, "meta")
    raw_parts = body.get("parts")
    _need(isinstance(raw_parts, list) and len(raw_parts) >= 1, "parts must be a non-empty list", path, "parts")
    seen_files: set[str] = set()
    seen_parts: set[str] = set()
    parts: list[PartEntry | PartRef] = []
    for pi, rp in enumerate(raw_parts):
        where = f"parts[{pi}]"
        if major >= 2 and isinstance(rp, dict) and "manifest" in rp:
            parts.append(_validate_ref(rp, path, where, seen_files, seen_parts))
        else:
            parts.append(_validate_part(rp, major, path, where, seen_files, seen_parts))
    return Manifest(
        id=cid,
        kind=kind,
        step=step,
        created_at=created,
        package_version=pv,
        parts=PartList(parts),
        meta=meta,
        version=version,
    )


def _validate_ref(rp: dict[str, Any], path: str | None, where: str, seen_files: set[str], seen_parts: set[str]) -> PartRef:
    # Checks first, messages only on failure: a MANIFEST may list thousands of references
    # and `ckpt inspect` decodes every one (format-2.md §V.9).
    k = knobs()

    def bad(msg: str, at: str = where) -> None:
        raise FormatError(f"invalid manifest: {msg}", path=path, key=at)

    pname = check_name(rp.get("name"), what="part", path=path)
    if pname in seen_parts:
        bad(f"duplicate part name {pname!r}")
    seen_parts.add(pname)
    man = rp.get("manifest")
    if type(man) is not list or len(man) != 3:
        bad("a part reference's manifest must be [name, size, digest]")
    mname, msize, mdigest = man
    check_name(mname, what="part manifest", path=path)
    if mname in seen_files:
        bad(f"duplicate file name {mname!r}")
    seen_files.add(mname)
    if not _int(msize, HEADER_SIZE + DIGEST_SIZE, k.max_manifest_bytes + HEADER_SIZE + DIGEST_SIZE):
        bad(f"part manifest size {msize!r} out of range")
    if type(mdigest) is not bytes or len(mdigest) != DIGEST_SIZE:
        bad("part manifest digest must be 16 bytes")
    sizes = rp.get("sizes")
    if type(sizes) is not list or not 1 <= len(sizes) <= 64:
        bad("sizes must list 1 to 64 files")
    out = []
    limit = k.max_file_bytes
    for fi, e in enumerate(sizes):
        if type(e) is not list or len(e) != 2:
            bad("a sizes entry must be [name, size]", f"{where}.sizes[{fi}]")
        name, size = e
        check_name(name, what="file", path=path)
        if name in seen_files:
            bad(f"duplicate file name {name!r}", f"{where}.sizes[{fi}]")
        seen_files.add(name)
        if type(size) is not int or not 0 <= size <= limit:
            bad(f"file size {size!r} out of range", f"{where}.sizes[{fi}]")
        out.append((name, size))
    return PartRef(pname, mname, msize, mdigest, tuple(out))


def _validate_part(
    rp: Any, major: int, path: str | None, where: str, seen_files: set[str], seen_parts: set[str]
) -> PartEntry:
    k = knobs()
    v2 = major >= 2
    _need(isinstance(rp, dict), "part is not a map", path, where)
    pname = check_name(rp.get("name"), what="part", path=path)
    _need(pname not in seen_parts, f"duplicate part name {pname!r}", path, where)
    seen_parts.add(pname)
    raw_files = rp.get("files")
    _need(isinstance(raw_files, list) and len(raw_files) <= 64, "files must be a short list", path, where)
    files = []
    for fi, rf in enumerate(raw_files):
        fw = f"{where}.files[{fi}]"
        _need(isinstance(rf, list) and len(rf) == (8 if v2 else 7), f"file entry must have {8 if v2 else 7} fields", path, fw)
        name, role, size, cs, digests, codec, raw_size = rf[:7]
        origin = rf[7] if v2 else None
        check_name(name, what="file", path=path)
        _need(name not in seen_files, f"duplicate file name {name!r}", path, fw)
        seen_files.add(name)
        _need(role in (ROLES_V2 if v2 else ROLES), f"unknown role {role!r}", path, fw)
        _need(_int(size, 0, k.max_file_bytes), f"file size {size!r} out of range", path, fw)
        _need(_int(cs, k.min_chunk_size, k.max_chunk_size), f"chunk size {cs!r} out of range", path, fw)
        _need(isinstance(digests, bytes), "digests must be bytes", path, fw)
        _need(len(digests) == DIGEST_SIZE * chunk_count(size, cs), "digest list length does not fit the size", path, fw)
        _need(codec in CODECS, f"unknown codec {codec!r}", path, fw)
        _need(
            raw_size is None if codec is None else _int(raw_size, 0, k.max_state_raw_bytes),
            "raw_size must be set exactly when a codec is",
            path,
            fw,
        )
        _need(role == "state" or codec is None, "tensor files are never compressed", path, fw)
        # A state file is read whole into memory: bound it by the state limit whatever
        # its codec (a zstd frame never exceeds its content by more than a few bytes
        # per 128 KiB block, so the raw limit plus 1/64 covers any honest frame).
        _need(
            role != "state" or size <= k.max_state_raw_bytes + (k.max_state_raw_bytes >> 6) + 4096,
            f"state file size {size} above the state document limit",
            path,
            fw,
        )
        if origin is not None:
            check_name(origin, what="origin", path=path)
            _need(role != "state", "a state file is always written by its save (origin must be nil)", path, fw)
        files.append(FileEntry(name, role, size, cs, digests, codec, raw_size, origin))
    _need(sum(f.role == "state" for f in files) == 1, "a part needs exactly one state file", path, where)
    if not v2:
        _need(sum(f.role == "tensors" for f in files) <= 1, "a part has at most one tensor file", path, where)
    raw_tensors = rp.get("tensors")
    _need(isinstance(raw_tensors, list), "tensors must be a list", path, where)
    seen_keys: set[str] = set()
    tensors = []
    # The checks of every tensor entry, each message built only when it fails: a part of
    # thousands of tensors, or thousands of parts, is validated on every open.
    arity = 8 if v2 else 6
    rank_max, dim_max, file_max, last_file = k.max_tensor_rank, 2**62, k.max_file_bytes, len(files) - 1
    known_dtypes, itemsize = dtypes.DTYPES, dtypes.itemsize
    for ti, rt in enumerate(raw_tensors):
        def bad(msg: str) -> None:
            raise FormatError(f"invalid manifest: {msg}", path=path, key=f"{where}.tensors[{ti}]")

        if type(rt) is not list or len(rt) != arity:
            bad(f"tensor entry must have {arity} fields")
        key, dt, shape, fidx, off, nbytes = rt[:6]
        digest, enc = (rt[6], rt[7]) if v2 else (None, None)
        if type(key) is not str or not 0 < len(key) <= 4096:
            bad("bad tensor key")
        if key in seen_keys:
            bad(f"duplicate tensor key {key!r}")
        seen_keys.add(key)
        if type(dt) is not str or dt not in known_dtypes:
            bad(f"unknown dtype {dt!r}")
        if type(shape) is not list or len(shape) > rank_max:
            bad("bad shape")
        numel = 1
        span = 1  # product of max(d, 1): an empty tensor's strides still multiply out
        for d in shape:
            if type(d) is not int or not 0 <= d <= dim_max:
                bad("bad shape")
            numel *= d
            span *= d if d > 1 else 1
        if span > dim_max:
            bad("shape's element count overflows (product of the nonzero dimensions above 2^62)")
        if nbytes != numel * itemsize(dt) or type(nbytes) is not int:
            bad("nbytes does not match dtype and shape")
        if digest is not None and (type(digest) is not bytes or len(digest) != DIGEST_SIZE):
            bad("digest must be nil or 16 bytes")
        stored = None
        encoding = None
        if enc is not None:
            if type(enc) is not list or len(enc) != 2 or type(enc[0]) is not str:
                bad("encoding must be [name, stored]")
            encoding, stored = enc
            if encoding not in ENCODINGS:
                bad(f"unknown encoding {encoding!r}")
            if not _int(stored, 16, file_max):
                bad(f"stored length {stored!r} out of range")
            if nbytes < 1:
                bad("an encoded tensor holds at least one byte of values")
            if nbytes > MAX_EXPANSION * stored:
                bad(f"{nbytes} values cannot come from {stored} stored bytes (expansion above {MAX_EXPANSION})")
        role = "tensors" if encoding is None else "packed"
        if not _int(fidx, 0, last_file) or files[fidx].role != role:
            bad(f"bad file index (needs a {role} file)")
        extent = nbytes if encoding is None else stored
        if not _int(off, 0, file_max) or off + extent > files[fidx].size:
            bad("tensor outside its file")
        if files[fidx].origin is not None and digest is None:
            bad("a tensor in a shared file needs a digest")
        tensors.append(TensorEntry(key, dt, tuple(shape), fidx, off, nbytes, digest, encoding, stored))
    if v2:
        _check_data_files(files, tensors, path, where)
    summary = rp.get("summary")
    _need(isinstance(summary, dict), "summary must be a map", path, where)
    return PartEntry(pname, tuple(files), tuple(tensors), summary)


def _check_data_files(files: list[FileEntry], tensors: list[TensorEntry], path: str | None, where: str) -> None:
    """format-2.md §V.2.1 and §V.2.4, as far as the MANIFEST alone tells (safetensors
    headers are checked against their entries when read)."""
    by_file: dict[int, list[TensorEntry]] = {}
    for t in tensors:
        by_file.setdefault(t.file, []).append(t)
    for i, f in enumerate(files):
        if f.role == "state":
            continue
        mine = by_file.get(i, [])
        _need(bool(mine), f"file {f.name!r} holds no tensor of its part", path, f"{where}.files[{i}]")
        if f.role != "packed":
            continue
        pos = 0
        for t in sorted(mine, key=lambda t: t.offset):
            if f.origin is None:
                _need(t.offset == pos, f"packed file {f.name!r} has a hole or overlap at {pos}", path, f"{where}.files[{i}]")
            else:
                _need(t.offset >= pos, f"packed spans overlap in {f.name!r} at {t.offset}", path, f"{where}.files[{i}]")
            pos = t.offset + t.stored_nbytes
        _need(f.origin is not None or pos == f.size, f"packed file {f.name!r} has {f.size - pos} bytes after its last span",
              path, f"{where}.files[{i}]")
