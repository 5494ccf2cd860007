"""Generate the format 2.0 test vectors in ``spec/vectors/checkpoint-v2/`` (spec/format-2.md §V.10).

    python spec/vectors/make_v2_vectors.py [OUT_DIR]

Same ``expected.json`` schema and the same fixed context as ``make_vectors.py`` (format 1.0):
packed tensors (BPZ1 byte planes + zstd), files shared from an earlier checkpoint of the run,
and part manifests; then hostile variants, each re-signed (chunk digests, content id, MANIFEST
and part manifest digests) so that only the rule under test can refuse it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import msgpack  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402

from ckpt.format import bpz  # noqa: E402
from ckpt.format.digest import ChunkHasher, digest_bytes  # noqa: E402
from ckpt.format.manifest import MANIFEST_NAME  # noqa: E402

_spec = importlib.util.spec_from_file_location("make_vectors", HERE / "make_vectors.py")
assert _spec is not None and _spec.loader is not None
v1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(v1)

__all__ = ["main", "build", "sign_v2", "raw_body_v2"]

CHUNK = v1.CHUNK
STEP_DIR = v1.STEP_DIR


# --- re-signing (format 2.0: 8-element entries, part references) ------------------------------------------


def raw_body_v2(ck: Path) -> dict[str, Any]:
    return v1._raw_body(ck)


def _ids(body: dict[str, Any]) -> list[Any]:
    out = []
    for p in body["parts"]:
        if "manifest" in p:
            out.append([p["name"], [list(p["manifest"])]])
        else:
            out.append([p["name"], [[f[0], f[2], f[4]] for f in p["files"]]])
    return out


def sign_v2(ck: Path, body: dict[str, Any], *, fix_id: bool = True, major: int = 2) -> None:
    """Write ``body`` as a 2.0 MANIFEST with its content id (§V.2.5) and digest recomputed."""
    if fix_id:
        body["id"] = digest_bytes(msgpack.packb(_ids(body), use_bin_type=True)).hex()
    (ck / MANIFEST_NAME).write_bytes(v1._hand_manifest(body, major=major))


def _frame(magic: bytes, body: Any, major: int = 2, minor: int = 0) -> bytes:
    b = msgpack.packb(body, use_bin_type=True)
    head = struct.pack("<8sHHIQ", magic, major, minor, 0, len(b))
    return head + b + digest_bytes(head + b)


def _chunk_digests(data: bytes, chunk: int) -> bytes:
    h = ChunkHasher(chunk)
    h.update(data)
    return h.finish()


def replace_file(ck: Path, name: str, data: bytes, *, edit_tensors: Callable[[list[Any]], None] | None = None) -> None:
    """Replace file ``name`` of an inline part and re-sign size, chunk digests and id;
    ``edit_tensors`` may adjust that part's tensor entries (a span's stored length)."""
    (ck / name).write_bytes(data)
    body = raw_body_v2(ck)
    for p in body["parts"]:
        for f in p.get("files", []):
            if f[0] == name:
                f[2], f[4] = len(data), _chunk_digests(data, f[3])
                if edit_tensors is not None:
                    edit_tensors(p["tensors"])
    sign_v2(ck, body)


def replace_span(ck: Path, key: str, span: bytes) -> None:
    """Put ``span`` in place of packed tensor ``key``'s (first part) and re-sign: its stored
    length, the offsets of the spans after it, the packed file's size and chunk digests,
    the content id."""
    pf = _packed_file(ck)
    e = _first_packed(raw_body_v2(ck), key)
    data = (ck / pf).read_bytes()
    delta = len(span) - e[7][1]

    def edit(ts: list[Any]) -> None:
        for t in ts:
            if t[0] == key:
                t[7][1] = len(span)
            elif t[7] is not None and t[4] > e[4]:
                t[4] += delta

    replace_file(ck, pf, data[: e[4]] + span + data[e[4] + e[7][1] :], edit_tensors=edit)


def _part_body(ck: Path, mname: str) -> dict[str, Any]:
    data = (ck / mname).read_bytes()
    (n,) = struct.unpack_from("<Q", data, 16)
    return msgpack.unpackb(data[24 : 24 + n], raw=False, strict_map_key=False)


def resign_part_manifest(ck: Path, mname: str, body: dict[str, Any], *, magic: bytes = b"CKPTPART", minor: int = 0) -> None:
    """Rewrite a part manifest and its reference's size and digest in the MANIFEST."""
    blob = _frame(magic, body, minor=minor)
    (ck / mname).write_bytes(blob)
    top = raw_body_v2(ck)
    for p in top["parts"]:
        if "manifest" in p and p["manifest"][0] == mname:
            p["manifest"][1], p["manifest"][2] = len(blob), digest_bytes(blob)
    sign_v2(ck, top)


# --- packed spans by hand --------------------------------------------------------------------------------


def _span(values: bytes, itemsize: int, planes: list[tuple[int, bytes]] | None = None, *, magic: bytes = bpz.MAGIC) -> bytes:
    """A one-block span; ``planes`` overrides each plane as (codec, stored bytes)."""
    if planes is None:
        planes = [(0, bytes(values[p::itemsize])) for p in range(itemsize)]
    head = bytes(c for c, _ in planes) + struct.pack(f"<{itemsize}I", *(len(b) for _, b in planes))
    block = max(4096, len(values))  # one block: every itemsize divides 4096
    return struct.pack("<4sB3sI4s", magic, itemsize, b"\0\0\0", block, b"\0\0\0\0") + head + b"".join(b for _, b in planes)


def _zstd_with_size(data: bytes, declared: int | None) -> bytes:
    """A zstd frame of ``data`` whose header declares ``declared`` bytes (None: no size)."""
    if declared is None:
        c = zstandard.ZstdCompressor(level=1, write_content_size=False, write_checksum=False)
        return c.compress(data)
    # Frame header descriptor with an 8-byte Frame_Content_Size and the single-segment
    # flag off, then a window descriptor; the blocks come from a real frame of ``data``.
    real = zstandard.ZstdCompressor(level=1, write_content_size=False, write_checksum=False).compress(data)
    params = zstandard.get_frame_parameters(real)
    assert params.content_size == zstandard.CONTENTSIZE_UNKNOWN
    fhd = real[4]
    assert fhd & 0b1100_0000 == 0 and not fhd & 0b0010_0000  # no FCS, window descriptor present
    return real[:4] + bytes([fhd | 0b1100_0000]) + real[5:6] + struct.pack("<Q", declared) + real[6:]


# --- building ----------------------------------------------------------------------------------------------


def _pattern(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Weights-like values without a random generator: small, smooth, sign-alternating."""
    x = torch.arange(n, dtype=torch.float64)
    return (torch.sin(x * 0.37 + seed) * 0.02).to(dtype)


def _every_dtype_state() -> dict[str, Any]:
    st = v1.every_dtype_state()
    return {"dtypes": {k: {"vec": v["vec"]} for k, v in st["dtypes"].items()}}


def _write(path: Path, state: dict[str, Any], **kw: Any) -> None:
    """make_vectors._write: fixed context and created_at; takes compress=, dedup=,
    dedup_from= and part_manifests= too."""
    v1._write(path, state, **kw)


def _packed_state() -> dict[str, Any]:
    return {"model": {"w32": _pattern(torch.float32, 1024, 1).reshape(32, 32), "w16": _pattern(torch.bfloat16, 128, 2),
                      "w64": _pattern(torch.float64, 64, 3), "bias": _pattern(torch.float32, 8, 4), "steps": torch.arange(3)}}


def _packed_policy(key: str, dtype: str, nbytes: int) -> bool:
    return key != "model/bias" and dtype != "int64"


def _shared_states() -> tuple[dict[str, Any], dict[str, Any]]:
    frozen, pfrozen = _pattern(torch.float32, 128, 5), _pattern(torch.float32, 256, 6)
    first = {"model": {"frozen": frozen, "trained": _pattern(torch.float32, 4, 7)},
             "packed": {"frozen": pfrozen, "trained": _pattern(torch.float32, 4, 8)}}
    second = {"model": {"frozen": frozen.clone(), "trained": _pattern(torch.float32, 4, 9)},
              "packed": {"frozen": pfrozen.clone(), "trained": _pattern(torch.float32, 4, 10)}}
    return first, second


def _parts_states() -> list[tuple[str, dict[str, Any]]]:
    return [(f"rank-{r:05d}", {"model": {"w": _pattern(torch.float32, 6, r)}, "rank": {"r": r}}) for r in range(3)]


def _packed_file(ck: Path) -> str:
    return next(n for n in os.listdir(ck) if n.endswith(".bpz"))


def _first_packed(body: dict[str, Any], key: str) -> list[Any]:
    return next(t for t in body["parts"][0]["tensors"] if t[0] == key)


def build(out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    made: list[str] = []

    def fresh(name: str) -> Path:
        vec = out / name
        shutil.rmtree(vec, ignore_errors=True)
        vec.mkdir()
        made.append(name)
        return vec

    def ok(name: str, state_by_part: dict[str, dict[str, Any]], description: str, **kw: Any) -> Path:
        vec = fresh(name)
        ck = vec / STEP_DIR
        parts = list(state_by_part.items())
        _write(ck, {}, parts=parts, **kw)
        v1._describe_ok(vec, ck, state_by_part, description)
        return ck

    def bad(name: str, mutate: Callable[[Path], str | None], error: str, stage: str, description: str,
            *, base: Callable[[Path], None] | None = None) -> None:
        vec = fresh(name)
        ck = vec / STEP_DIR
        if base is None:
            _write(ck, _packed_state(), compress=_packed_policy)
        else:
            base(ck)
        path = mutate(ck)
        v1._describe_error(vec, path if isinstance(path, str) else STEP_DIR, error, stage, description)

    # --- valid ---
    ok("valid-packed-float32-bfloat16", {"rank-00000": _packed_state()},
       "float32, bfloat16 and float64 tensors packed (BPZ1 byte planes, zstd where it pays) beside an unencoded "
       "float32 and int64 in the part's safetensors file.", compress=_packed_policy)
    ok("valid-packed-every-dtype", {"rank-00000": _every_dtype_state()},
       "A 3-element vector of every dtype, packed: 1, 2, 4, 8 and 16 planes.", compress=lambda k, d, n: True)

    vec = fresh("valid-shared-files")
    first, second = _shared_states()
    run = vec / "run"
    pol = lambda k, d, n: k.startswith("packed/")  # noqa: E731
    _write(run / "step-00000001", first, compress=pol, dedup=True)
    _write(run / STEP_DIR.replace("1", "2"), second, compress=pol, dedup_from=run / "step-00000001")
    shutil.rmtree(run / "step-00000001")  # the second stands on its own terms (§V.4.1)
    v1._describe_ok(vec, run / "step-00000002", {"rank-00000": second},
                    "A checkpoint sharing two files of an earlier one of its run (deleted since): origin set, an "
                    "unreferenced member in the shared safetensors file, a gap in the shared packed file.")
    import json

    exp = json.loads((vec / "expected.json").read_text())
    exp["path"] = "run/step-00000002"
    (vec / "expected.json").write_text(json.dumps(exp, indent=1, sort_keys=True) + "\n")

    ok("valid-part-manifests", dict(_parts_states()),
       "Three parts listed by reference: each part's files, tensors and summary in its own part manifest.",
       part_manifests=True)

    # --- invalid: packed spans ---
    W32 = "model/w32"

    def with_span(make: Callable[[bytes], bytes]) -> Callable[[Path], None]:
        """Replace w32's span by ``make(values)``; the span is first in the packed file."""
        def f(ck: Path) -> None:
            replace_span(ck, W32, make(_pattern(torch.float32, 1024, 1).numpy().tobytes()))
        return f

    def planes_of(values: bytes) -> list[tuple[int, bytes]]:
        return [(0, bytes(values[p::4])) for p in range(4)]

    def top_plane(frame: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
        def make(values: bytes) -> bytes:
            pl = planes_of(values)
            pl[3] = (1, frame(pl[3][1]))
            return _span(values, 4, pl)
        return make

    bad("invalid-zstd-plane-claims-1-gib", with_span(top_plane(lambda p: _zstd_with_size(p, 1 << 30))), "FormatError", "verify",
        "The exponent plane's zstd frame declares 1 GiB for a 1024-byte plane: refused before decompressing.")
    bad("invalid-zstd-plane-inflates", with_span(top_plane(lambda p: _zstd_with_size(p + p, len(p)))), "FormatError", "verify",
        "A frame that declares its plane's 1024 bytes but holds 2048: refused, never written past the plane.")
    bad("invalid-zstd-plane-no-content-size", with_span(top_plane(lambda p: _zstd_with_size(p, None))), "FormatError",
        "verify", "A zstd plane whose frame has no Frame_Content_Size.")
    bad("invalid-plane-reserved-codec", with_span(lambda v: _span(v, 4, [(0, bytes(v[0::4])), (0, bytes(v[1::4])),
                                                                          (2, bytes(v[2::4])), (0, bytes(v[3::4]))])),
        "FormatError", "verify", "Plane codec 2 (reserved).")

    def not_zstd(values: bytes) -> bytes:
        pl = planes_of(values)
        pl[3] = (1, b"\x28\xb5\x2f\xfe")
        return _span(values, 4, pl)

    bad("invalid-plane-not-zstd", with_span(not_zstd), "FormatError", "verify",
        "A plane marked zstd whose 4 stored bytes are not a zstd frame.")

    def zeros_base(ck: Path) -> None:
        _write(ck, {"mask": {"zeros": torch.zeros(40000, dtype=torch.uint8)}}, compress=lambda k, d, n: True)

    def expansion(ck: Path) -> None:
        pf = _packed_file(ck)
        span = _span(bytes(40000), 1, [(1, b"\x28")])

        def edit(ts: list[Any]) -> None:
            ts[0][7][1] = len(span)

        replace_file(ck, pf, span, edit_tensors=edit)

    bad("invalid-plane-expansion-bound", expansion, "FormatError", "verify",
        "A 40000-byte plane (uint8 zeros) stored in 1 byte: above the 32768x expansion bound, refused before any "
        "decompression.", base=zeros_base)
    bad("invalid-span-bad-magic", with_span(lambda v: _span(v, 4, magic=b"BPZ2")), "FormatError", "verify",
        "A span whose magic is BPZ2.")

    def short(ck: Path) -> None:
        pf = _packed_file(ck)
        body = raw_body_v2(ck)
        e = _first_packed(body, W32)
        assert e[4] == 0
        data = (ck / pf).read_bytes()
        new = data[: e[7][1] - 1] + data[e[7][1] :]

        def edit(ts: list[Any]) -> None:
            for t in ts:
                if t[0] == W32:
                    t[7][1] -= 1
                elif t[7] is not None:
                    t[4] -= 1

        replace_file(ck, pf, new, edit_tensors=edit)

    bad("invalid-span-one-byte-short", short, "FormatError", "verify",
        "The span's last byte removed (stored length and later offsets re-signed): the last block ends past the span.")

    def flip_packed(ck: Path) -> None:
        pf = _packed_file(ck)
        v1._flip(ck / pf, 40, 2)

    bad("invalid-flipped-bit-packed-file", flip_packed, "ChecksumMismatchError", "verify",
        "One bit flipped in the packed file: its chunk digest catches it before decoding.")

    def encoded_in_tensors_file(ck: Path) -> None:
        body = raw_body_v2(ck)
        p = body["parts"][0]
        sf = next(i for i, f in enumerate(p["files"]) if f[1] == "tensors")
        e = _first_packed(body, W32)
        e[3] = sf
        sign_v2(ck, body)

    bad("invalid-encoded-entry-in-tensors-file", encoded_in_tensors_file, "FormatError", "open",
        "A packed (encoded) entry pointing into the safetensors file.")

    def huge_claim(ck: Path) -> None:
        body = raw_body_v2(ck)
        e = _first_packed(body, W32)
        e[2], e[5], e[7][1] = [1 << 38], 1 << 40, 64
        sign_v2(ck, body)

    bad("invalid-encoded-tensor-expansion", huge_claim, "FormatError", "open",
        "An encoded float32 tensor of 2^38 values (2^40 bytes) in a 64-byte span: above 32768x, refused before "
        "anything is allocated.")

    def unreferenced_member(ck: Path) -> None:
        body = raw_body_v2(ck)
        p = body["parts"][0]
        p["tensors"] = [t for t in p["tensors"] if t[0] != "model/bias"]
        sign_v2(ck, body)

    bad("invalid-unreferenced-member", unreferenced_member, "FormatError", "verify",
        "The safetensors file keeps a member no entry references, and its origin is nil (written by this save).")

    def traversal_origin(ck: Path) -> None:
        body = raw_body_v2(ck)
        body["parts"][0]["files"][1][7] = "../x"
        sign_v2(ck, body)

    bad("invalid-origin-traversal", traversal_origin, "UnsafePathError", "open", "A file whose origin is ../x.")

    # --- invalid: shared files and digests ---
    def shared_base(ck: Path) -> None:
        first, second = _shared_states()
        pol = lambda k, d, n: k.startswith("packed/")  # noqa: E731
        _write(ck.parent / "step-00000000", first, compress=pol, dedup=True)
        _write(ck, second, compress=pol, dedup_from=ck.parent / "step-00000000")
        shutil.rmtree(ck.parent / "step-00000000")

    def wrong_digest(ck: Path) -> None:
        body = raw_body_v2(ck)
        t = next(t for t in body["parts"][0]["tensors"] if t[0] == "model/frozen")
        t[6] = bytes(16)
        sign_v2(ck, body)

    bad("invalid-tensor-digest", wrong_digest, "ChecksumMismatchError", "verify",
        "A shared tensor whose recorded digest does not match its values.", base=shared_base)

    def shared_without_digest(ck: Path) -> None:
        body = raw_body_v2(ck)
        t = next(t for t in body["parts"][0]["tensors"] if t[0] == "model/frozen")
        t[6] = None
        sign_v2(ck, body)

    bad("invalid-shared-tensor-without-digest", shared_without_digest, "FormatError", "open",
        "A tensor in a shared file without a digest (§V.2.4).", base=shared_base)

    # --- invalid: part manifests ---
    def parts_base(ck: Path) -> None:
        _write(ck, {}, parts=_parts_states(), part_manifests=True)

    def part_digest(ck: Path) -> None:
        data = bytearray((ck / "rank-00001.part").read_bytes())
        data[30] ^= 1
        (ck / "rank-00001.part").write_bytes(bytes(data))

    bad("invalid-part-manifest-digest", part_digest, "ChecksumMismatchError", "verify",
        "A flipped bit in a part manifest: the digest in its reference catches it.", base=parts_base)

    def part_name(ck: Path) -> None:
        b = _part_body(ck, "rank-00001.part")
        b["part"]["name"] = "rank-00009"
        resign_part_manifest(ck, "rank-00001.part", b)

    bad("invalid-part-manifest-name", part_name, "FormatError", "verify",
        "A part manifest holding part rank-00009 under the reference rank-00001 (re-signed).", base=parts_base)

    def part_sizes(ck: Path) -> None:
        b = _part_body(ck, "rank-00001.part")
        b["part"]["files"].reverse()
        for t in b["part"]["tensors"]:
            t[3] = len(b["part"]["files"]) - 1 - t[3]
        resign_part_manifest(ck, "rank-00001.part", b)

    bad("invalid-part-manifest-sizes", part_sizes, "FormatError", "verify",
        "A part manifest listing its files in another order than its reference's sizes.", base=parts_base)

    def part_version(ck: Path) -> None:
        resign_part_manifest(ck, "rank-00001.part", _part_body(ck, "rank-00001.part"), minor=1)

    bad("invalid-part-manifest-version", part_version, "FormatError", "verify",
        "A part manifest of version 2.1 under a 2.0 MANIFEST.", base=parts_base)

    bad("invalid-missing-part-manifest", lambda ck: os.unlink(ck / "rank-00002.part"), "MissingFileError", "open",
        "A part manifest named by its reference is absent.", base=parts_base)
    return made


def main(argv: list[str] | None = None) -> int:
    return v1.main(argv, builder=build, default="checkpoint-v2")


if __name__ == "__main__":
    sys.exit(main())
