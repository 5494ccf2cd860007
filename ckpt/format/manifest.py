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
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Any

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
]

MAGIC = b"CKPTMNFT"
FORMAT_MAJOR = 1
FORMAT_MINOR = 0
MANIFEST_NAME = "MANIFEST"
# A directory being written or deleted (spec §3): never a checkpoint; readers and listings skip it.
TMP_PREFIX = ".tmp-"
_HEADER = struct.Struct("<8sHHIQ")
HEADER_SIZE = _HEADER.size  # 24

# Used with fullmatch only: with match() "$" also matches before a trailing newline,
# so "step-1\n" passed.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
ROLES = ("tensors", "state")
CODECS = (None, "zstd")
KINDS = ("checkpoint", "snapshot")


def check_name(name: Any, *, what: str, path: str | None = None) -> str:
    """A file or part name: one path component, no traversal, no hidden files."""
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None or ".." in name or name == MANIFEST_NAME:
        raise UnsafePathError(f"unsafe or invalid {what} name {name!r}", path=path, key=str(name)[:80])
    return name


@dataclass(frozen=True, slots=True)
class FileEntry:
    name: str
    role: str  # "tensors" (a safetensors file) or "state" (msgpack, maybe zstd)
    size: int
    chunk_size: int
    digests: bytes  # DIGEST_SIZE bytes per chunk, concatenated
    codec: str | None = None
    raw_size: int | None = None

    def to_wire(self) -> list[Any]:
        return [self.name, self.role, self.size, self.chunk_size, self.digests, self.codec, self.raw_size]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    file: int  # index into the part's files
    offset: int  # absolute byte offset in that file
    nbytes: int

    def to_wire(self) -> list[Any]:
        return [self.key, self.dtype, list(self.shape), self.file, self.offset, self.nbytes]


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

    def to_dict(self) -> dict[str, Any]:
        """msgpack-able form, to send a part record from a writer process to the committer."""
        return self.to_wire()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PartEntry":
        # Trusted input from our own writer processes; the committed MANIFEST is
        # validated in full by every reader anyway.
        return cls(
            d["name"],
            tuple(FileEntry(*f) for f in d["files"]),
            tuple(TensorEntry(t[0], t[1], tuple(t[2]), t[3], t[4], t[5]) for t in d["tensors"]),
            dict(d["summary"]),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "files": [f.to_wire() for f in self.files],
            "tensors": [t.to_wire() for t in self.tensors],
            "summary": self.summary,
        }


@dataclass(frozen=True, slots=True)
class Manifest:
    id: str
    kind: str
    step: int | None
    created_at: float  # volatile: the only field two saves of the same state may differ in
    package_version: str
    parts: tuple[PartEntry, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    version: tuple[int, int] = (FORMAT_MAJOR, FORMAT_MINOR)

    def part(self, name: str | None = None) -> PartEntry:
        if name is None:
            if len(self.parts) == 1:
                return self.parts[0]
            raise KeyError(f"checkpoint has {len(self.parts)} parts; name one of {[p.name for p in self.parts]}")
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(f"no part {name!r}; parts are {[p.name for p in self.parts]}")

    @property
    def files(self) -> list[FileEntry]:
        return [f for p in self.parts for f in p.files]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def content_id(parts: tuple[PartEntry, ...]) -> str:
    """Deterministic id: a digest over every file's name, size and chunk digests."""
    body = packb([[p.name, [[f.name, f.size, f.digests] for f in p.files]] for p in parts])
    return digest_bytes(body).hex()


def encode_manifest(m: Manifest) -> bytes:
    body = packb(
        {
            "format": "ckpt-replay/checkpoint",
            "id": m.id,
            "kind": m.kind,
            "step": m.step,
            "created_at": m.created_at,
            "package_version": m.package_version,
            "parts": [p.to_wire() for p in m.parts],
            "meta": m.meta,
        }
    )
    if len(body) > knobs().max_manifest_bytes:
        raise LimitExceededError(f"manifest body of {len(body)} bytes exceeds the limit {knobs().max_manifest_bytes}")
    head = _HEADER.pack(MAGIC, m.version[0], m.version[1], 0, len(body))
    return head + body + digest_bytes(head + body)


# --- decoding ------------------------------------------------------------------------


def _need(cond: bool, msg: str, path: str | None, key: str | None = None) -> None:
    if not cond:
        raise FormatError(f"invalid manifest: {msg}", path=path, key=key)


def _int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def decode_manifest(data: bytes, *, path: str | None = None) -> Manifest:
    k = knobs()
    if len(data) < HEADER_SIZE + DIGEST_SIZE:
        raise FormatError(f"manifest is {len(data)} bytes, shorter than its fixed header", path=path, offset=len(data))
    magic, major, minor, flags, body_len = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise FormatError(f"bad magic {magic!r}, expected {MAGIC!r}", path=path, offset=0)
    if major != FORMAT_MAJOR:
        raise UnsupportedVersionError(
            f"format version {major}.{minor} is not supported by this reader (major {FORMAT_MAJOR})", path=path, offset=8
        )
    if flags != 0:
        raise FormatError(f"reserved flags are {flags:#x}, must be 0", path=path, offset=12)
    if body_len > k.max_manifest_bytes:
        raise LimitExceededError(
            f"manifest declares a {body_len}-byte body, above the limit {k.max_manifest_bytes}", path=path, offset=16
        )
    expected = HEADER_SIZE + body_len + DIGEST_SIZE
    if len(data) != expected:
        raise FormatError(
            f"manifest is {len(data)} bytes, header says {expected}", path=path, offset=min(len(data), expected)
        )
    end = HEADER_SIZE + body_len
    if digest_bytes(data[:end]) != data[end:]:
        from ..errors import ChecksumMismatchError

        raise ChecksumMismatchError("manifest digest does not match its bytes", path=path, offset=end)
    body = unpackb(memoryview(data)[HEADER_SIZE:end], path=path, what="manifest body", offset=HEADER_SIZE)
    m = _validate(body, (major, minor), path)
    if content_id(m.parts) != m.id:
        # Spec §5.2: readers MUST recompute the id. The manifest digest covers the id,
        # so this only trips on a writer bug or a hand-edited manifest that was re-signed.
        from ..errors import ChecksumMismatchError

        raise ChecksumMismatchError("manifest id does not match the digest of its parts", path=path, key="id")
    return m


def _validate(body: Any, version: tuple[int, int], path: str | None) -> Manifest:
    k = knobs()
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
    parts = []
    for pi, rp in enumerate(raw_parts):
        where = f"parts[{pi}]"
        _need(isinstance(rp, dict), "part is not a map", path, where)
        pname = check_name(rp.get("name"), what="part", path=path)
        _need(pname not in seen_parts, f"duplicate part name {pname!r}", path, where)
        seen_parts.add(pname)
        raw_files = rp.get("files")
        _need(isinstance(raw_files, list) and len(raw_files) <= 64, "files must be a short list", path, where)
        files = []
        for fi, rf in enumerate(raw_files):
            fw = f"{where}.files[{fi}]"
            _need(isinstance(rf, list) and len(rf) == 7, "file entry must have 7 fields", path, fw)
            name, role, size, cs, digests, codec, raw_size = rf
            check_name(name, what="file", path=path)
            _need(name not in seen_files, f"duplicate file name {name!r}", path, fw)
            seen_files.add(name)
            _need(role in ROLES, f"unknown role {role!r}", path, fw)
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
            files.append(FileEntry(name, role, size, cs, digests, codec, raw_size))
        _need(sum(f.role == "state" for f in files) == 1, "a part needs exactly one state file", path, where)
        _need(sum(f.role == "tensors" for f in files) <= 1, "a part has at most one tensor file", path, where)
        raw_tensors = rp.get("tensors")
        _need(isinstance(raw_tensors, list), "tensors must be a list", path, where)
        seen_keys: set[str] = set()
        tensors = []
        for ti, rt in enumerate(raw_tensors):
            tw = f"{where}.tensors[{ti}]"
            _need(isinstance(rt, list) and len(rt) == 6, "tensor entry must have 6 fields", path, tw)
            key, dt, shape, fidx, off, nbytes = rt
            _need(isinstance(key, str) and 0 < len(key) <= 4096, "bad tensor key", path, tw)
            _need(key not in seen_keys, f"duplicate tensor key {key!r}", path, tw)
            seen_keys.add(key)
            _need(isinstance(dt, str) and dt in dtypes.DTYPES, f"unknown dtype {dt!r}", path, tw)
            _need(
                isinstance(shape, list) and len(shape) <= k.max_tensor_rank and all(_int(s, 0, 2**62) for s in shape),
                "bad shape",
                path,
                tw,
            )
            _need(_int(fidx, 0, len(files) - 1) and files[fidx].role == "tensors", "bad file index", path, tw)
            numel = 1
            span = 1  # product of max(d, 1): an empty tensor's strides still multiply out
            for s in shape:
                numel *= s
                span *= max(s, 1)
            _need(span <= 2**62, "shape's element count overflows (product of the nonzero dimensions above 2^62)", path, tw)
            _need(nbytes == numel * dtypes.itemsize(dt), "nbytes does not match dtype and shape", path, tw)
            _need(_int(off, 0, k.max_file_bytes) and off + nbytes <= files[fidx].size, "tensor outside its file", path, tw)
            tensors.append(TensorEntry(key, dt, tuple(shape), fidx, off, nbytes))
        summary = rp.get("summary")
        _need(isinstance(summary, dict), "summary must be a map", path, where)
        parts.append(PartEntry(pname, tuple(files), tuple(tensors), summary))
    return Manifest(
        id=cid,
        kind=kind,
        step=step,
        created_at=created,
        package_version=pv,
        parts=tuple(parts),
        meta=meta,
        version=version,
    )
