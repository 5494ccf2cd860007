"""Generate the checkpoint-format test vectors in ``spec/vectors/checkpoint/``.

    python spec/vectors/make_vectors.py [OUT_DIR]

Each vector is a directory holding one checkpoint directory (or a damaged one) and an
``expected.json`` that says what a conforming reader must do with it::

    {"description": ..., "path": "<dir to open, relative to the vector>",
     "result": "ok" | "error",
     "error": "<class name from ckpt.errors>",        # result == "error"
     "stage": "open" | "verify" | "state",            # where the error must surface
     "manifest": {...}, "tensors": {...}, "state": {...}}   # result == "ok"

Stages: ``open`` reads MANIFEST and checks the directory; ``verify`` re-hashes every
chunk of every file; ``state`` decodes the structure file and reads every tensor.
Every stage before the named one must succeed.

Expected trees use a small tagged JSON, because JSON cannot hold NaN payloads, bytes,
tuples, big integers or non-string map keys:
``{"$float": "<16 hex digits of the IEEE-754 bits, big-endian>"}``, ``{"$bytes": hex}``,
``{"$tuple": [...]}``, ``{"$int": "<decimal>"}``, ``{"$map": [[key, value], ...]}``,
``{"$tensor": "<key in the tensors table>"}``, ``{"$dtype": name}``, ``{"$device": str}``.
Tensors are described by ``dtype``, ``shape`` and ``hex``: their bytes, row-major,
little-endian.

The output is deterministic: the volatile ``created_at`` is fixed, and the parts of
the context that describe the machine (environment, topology, commit) are replaced by
fixed values, so the same library versions produce the same bytes anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import math
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

import ckpt.writer as writer  # noqa: E402
from ckpt.format import dtypes  # noqa: E402
from ckpt.format.codec import zstd_compress  # noqa: E402
from ckpt.format.digest import ChunkHasher, digest_bytes  # noqa: E402
from ckpt.format.manifest import MANIFEST_NAME, content_id, decode_manifest, encode_manifest  # noqa: E402
from ckpt.format.tree import EXT_TUPLE  # noqa: E402
from ckpt.knobs import override  # noqa: E402

__all__ = ["main", "to_tagged", "from_tagged", "tensor_hex", "CREATED_AT", "CHUNK"]

CREATED_AT = 1_700_000_000.0
CHUNK = 4096
STEP_DIR = "step-00000001"

FIXED_ENV = {
    "python": "3.11.0",
    "implementation": "cpython",
    "platform": "vector",
    "machine": "x86_64",
    "torch": "2.13.0",
    "cuda": None,
    "cudnn": None,
    "nccl": None,
    "numpy": None,
    "ckpt_replay": "0.1.0",
    "deterministic_algorithms": False,
    "deterministic_warn_only": False,
    "cudnn_deterministic": False,
    "cudnn_benchmark": False,
    "allow_tf32_matmul": False,
    "allow_tf32_cudnn": True,
    "float32_matmul_precision": "highest",
    "num_threads": 1,
    "num_interop_threads": 1,
    "env": {k: None for k in ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                              "MKL_CBWR", "NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE")},
}
FIXED_TOPOLOGY = {
    "distributed": False,
    "world_size": 1,
    "rank": 0,
    "local_rank": None,
    "local_world_size": None,
    "backend": None,
    "hostname": "vector-host",
    "device_kind": "cpu",
    "device_count": 0,
    "device_names": [],
}
FIXED_COMMIT = {"available": False, "sha": None, "dirty": None, "diff_sha256": None, "repo": None, "reason": "test vector"}


# --- tagged JSON -------------------------------------------------------------------------------------------


def to_tagged(v: Any) -> Any:
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v if -(2**53) <= v <= 2**53 else {"$int": str(v)}
    if isinstance(v, float):
        return {"$float": struct.pack(">d", v).hex()}
    if isinstance(v, bytes):
        return {"$bytes": v.hex()}
    if isinstance(v, tuple):
        return {"$tuple": [to_tagged(x) for x in v]}
    if isinstance(v, list):
        return [to_tagged(x) for x in v]
    if isinstance(v, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in v):
            return {k: to_tagged(x) for k, x in v.items()}
        return {"$map": [[to_tagged(k), to_tagged(x)] for k, x in v.items()]}
    if isinstance(v, torch.dtype):
        return {"$dtype": dtypes.dtype_name(v)}
    if isinstance(v, torch.device):
        return {"$device": str(v)}
    raise TypeError(f"no tagged form for {type(v).__name__}")


def from_tagged(v: Any, tensors: Callable[[str], Any]) -> Any:
    if isinstance(v, list):
        return [from_tagged(x, tensors) for x in v]
    if not isinstance(v, dict):
        return v
    if len(v) == 1:
        (tag, x), = v.items()
        if tag == "$int":
            return int(x)
        if tag == "$float":
            return struct.unpack(">d", bytes.fromhex(x))[0]
        if tag == "$bytes":
            return bytes.fromhex(x)
        if tag == "$tuple":
            return tuple(from_tagged(e, tensors) for e in x)
        if tag == "$map":
            return {from_tagged(k, tensors): from_tagged(e, tensors) for k, e in x}
        if tag == "$tensor":
            return tensors(x)
        if tag == "$dtype":
            return dtypes.torch_dtype(x)
        if tag == "$device":
            return torch.device(x)
    return {k: from_tagged(x, tensors) for k, x in v.items()}


def tensor_hex(t: torch.Tensor) -> str:
    c = t.detach().resolve_conj().resolve_neg().contiguous().cpu()
    return writer.tensor_memoryview(c).tobytes().hex()


# --- building ------------------------------------------------------------------------------------------------


def _write(path: Path, state: dict[str, Any], **kw: Any) -> None:
    """One part, no RNG, fixed context, fixed created_at."""
    saved = (writer.capture_env, writer.capture_topology, writer.capture_commit, writer.__version__)
    writer.capture_env = lambda: dict(FIXED_ENV)
    writer.capture_topology = lambda: dict(FIXED_TOPOLOGY)
    writer.capture_commit = lambda code_dir=None: dict(FIXED_COMMIT)
    writer.__version__ = "0.1.0"
    try:
        with override(chunk_size=CHUNK, bpz_block=4096):
            parts = kw.pop("parts", None)
            # format 2.0 vectors (make_v2_vectors.py): part manifests, a dedup source
            pending = writer.begin(path, part_manifests=kw.pop("part_manifests", False))
            dedup_from = kw.pop("dedup_from", None)
            try:
                kw.setdefault("lineage", {"run_id": None, "resumed_from": None})  # §8.6
                pes = []
                for name, st in parts if parts is not None else [(writer.part_name_for_rank(0), state)]:
                    reuse = writer.reuse_from(dedup_from, name) if dedup_from is not None else None
                    pes.append(writer.write_part(pending, name, st, rng=False, step=1, reuse=reuse, **kw))
                writer.commit(pending, pes, step=1)
            except BaseException:
                writer.abort(pending)
                raise
    finally:
        writer.capture_env, writer.capture_topology, writer.capture_commit, writer.__version__ = saved
    m = decode_manifest((path / MANIFEST_NAME).read_bytes())
    (path / MANIFEST_NAME).write_bytes(encode_manifest(dataclasses.replace(m, created_at=CREATED_AT)))


def _reseal(ck: Path, name: str, data: bytes, *, raw_size: int | None = None) -> None:
    """Replace a file and re-sign the manifest for it (size, chunk digests, id)."""
    (ck / name).write_bytes(data)
    m = decode_manifest((ck / MANIFEST_NAME).read_bytes())
    h = ChunkHasher(CHUNK)
    h.update(data)
    digests = h.finish()
    parts = []
    for pe in m.parts:
        files = tuple(
            dataclasses.replace(f, size=len(data), digests=digests, raw_size=f.raw_size if raw_size is None else raw_size)
            if f.name == name
            else f
            for f in pe.files
        )
        parts.append(dataclasses.replace(pe, files=files))
    (ck / MANIFEST_NAME).write_bytes(encode_manifest(dataclasses.replace(m, parts=tuple(parts), id=content_id(tuple(parts)))))


def _raw_body(ck: Path) -> dict[str, Any]:
    data = (ck / MANIFEST_NAME).read_bytes()
    (n,) = struct.unpack_from("<Q", data, 16)
    return msgpack.unpackb(data[24 : 24 + n], raw=False, strict_map_key=False)


def _hand_manifest(body: Any, *, magic: bytes = b"CKPTMNFT", major: int = 1, minor: int = 0, body_bytes: bytes | None = None) -> bytes:
    b = msgpack.packb(body, use_bin_type=True) if body_bytes is None else body_bytes
    head = struct.pack("<8sHHIQ", magic, major, minor, 0, len(b))
    return head + b + digest_bytes(head + b)


def _sign_raw(ck: Path, body: Any, *, fix_id: bool = True, body_bytes: bytes | None = None) -> None:
    """Write a raw (possibly hostile) body as MANIFEST: content id (§5.2) and digest right."""
    if fix_id:
        ids = [[p["name"], [[f[0], f[2], f[4]] for f in p["files"]]] for p in body["parts"]]
        body["id"] = digest_bytes(msgpack.packb(ids, use_bin_type=True)).hex()
    (ck / MANIFEST_NAME).write_bytes(_hand_manifest(body, body_bytes=body_bytes))


def _reseal_raw(ck: Path, name: str, data: bytes, *, raw_size: int | None = None, shift: int = 0) -> None:
    """Replace a file, re-sign it in the raw body; ``shift`` moves every tensor offset."""
    (ck / name).write_bytes(data)
    body = _raw_body(ck)
    for p in body["parts"]:
        for f in p["files"]:
            if f[0] == name:
                h = ChunkHasher(f[3])
                h.update(data)
                f[2], f[4] = len(data), h.finish()
                if raw_size is not None:
                    f[6] = raw_size
        for t in p["tensors"]:
            t[4] += shift
    _sign_raw(ck, body)


_SF = "rank-00000.safetensors"
_ST = "rank-00000.state.msgpack.zst"


def _state_doc(ck: Path) -> Any:
    import zstandard

    raw = zstandard.ZstdDecompressor().decompress((ck / _ST).read_bytes())
    return msgpack.unpackb(raw, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType)


def _put_state(ck: Path, raw: bytes) -> None:
    _reseal_raw(ck, _ST, zstd_compress(raw, 3), raw_size=len(raw))


def _edit_state(edit: Callable[[Any], Any], *, splice: tuple[bytes, bytes] | None = None) -> Callable[[Path], None]:
    """Edit the decoded state document; ``splice`` then replaces packed bytes (for
    documents a dict cannot hold, such as colliding keys)."""
    def f(ck: Path) -> None:
        doc = _state_doc(ck)
        edit(doc)
        raw = msgpack.packb(doc, use_bin_type=True)
        if splice is not None:
            assert raw.count(splice[0]) == 1
            raw = raw.replace(*splice)
        _put_state(ck, raw)
    return f


def _edit_header(edit: Callable[[dict[str, Any]], bytes]) -> Callable[[Path], None]:
    """Replace the safetensors JSON header by ``edit(header)`` (raw bytes, used as is)."""
    def f(ck: Path) -> None:
        data = (ck / _SF).read_bytes()
        (n,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(data[8 : 8 + n])
        new = edit(header)
        _reseal_raw(ck, _SF, struct.pack("<Q", len(new)) + new + data[8 + n :], shift=len(new) - n)
    return f


def _padded(obj: Any) -> bytes:
    b = json.dumps(obj, separators=(",", ":")).encode()
    return b + b" " * (-len(b) % 8)


def _edit_body(edit: Callable[[Any], Any], *, fix_id: bool = True) -> Callable[[Path], None]:
    def f(ck: Path) -> None:
        body = _raw_body(ck)
        edit(body)
        _sign_raw(ck, body, fix_id=fix_id)
    return f


def _flip(p: Path, pos: int, bit: int) -> None:
    b = bytearray(p.read_bytes())
    b[pos] ^= 1 << bit
    p.write_bytes(bytes(b))


def _describe_ok(vec: Path, ck: Path, state_by_part: dict[str, dict[str, Any]], description: str) -> None:
    m = decode_manifest((ck / MANIFEST_NAME).read_bytes())
    parts: dict[str, Any] = {}
    for part, st in state_by_part.items():
        table: dict[str, Any] = {}
        first: dict[int, str] = {}
        aliases: list[list[str]] = []

        def walk(v: Any, path: tuple[Any, ...], register: bool) -> Any:
            if isinstance(v, torch.Tensor):
                desc = {"dtype": dtypes.dtype_name(v.dtype), "shape": list(v.shape), "hex": tensor_hex(v)}
                where = "/".join(writer._escape(p) for p in path)
                if register:
                    if v.numel() and id(v) in first:
                        aliases.append([first[id(v)], where])
                    else:
                        table[where] = desc
                        first[id(v)] = where
                return {"$tensor": desc}
            if isinstance(v, writer.Replicated):
                return walk(state_by_part[v.part][path[0]], path, False)
            if isinstance(v, dict):
                if all(isinstance(k, str) and not k.startswith("$") for k in v):
                    return {k: walk(x, path + (k,), register) for k, x in v.items()}
                return {"$map": [[to_tagged(k), walk(x, path + (k,), register)] for k, x in v.items()]}
            if isinstance(v, list):
                return [walk(x, path + (i,), register) for i, x in enumerate(v)]
            if isinstance(v, tuple):
                return {"$tuple": [walk(x, path + (i,), register) for i, x in enumerate(v)]}
            return to_tagged(v)

        tree = {k: walk(v, (k,), True) for k, v in st.items()}
        parts[part] = {"tensors": table, "state": tree, "aliases": aliases}
    expected = {
        "description": description,
        "path": ck.name,
        "result": "ok",
        "manifest": {
            "id": m.id,
            "version": list(m.version),
            "kind": m.kind,
            "step": m.step,
            "created_at": {"$float": struct.pack(">d", m.created_at).hex()},
            "files": sorted(n for n, _, part_manifest in m.parts.file_sizes() if not part_manifest),
        },
        "parts": parts,
    }
    _dump(vec, expected)


def _describe_error(vec: Path, path: str, error: str, stage: str, description: str) -> None:
    _dump(vec, {"description": description, "path": path, "result": "error", "error": error, "stage": stage})


def _dump(vec: Path, obj: dict[str, Any]) -> None:
    (vec / "expected.json").write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


# --- the vectors ------------------------------------------------------------------------------------------------


def tiny_model_state() -> dict[str, Any]:
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8 - 0.5)
        model.bias.copy_(torch.tensor([0.25, -0.125, 1.0]))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.99), weight_decay=0.0)
    # one step with a hand-set gradient: no random numbers anywhere
    model.weight.grad = torch.full((3, 4), 0.5)
    model.bias.grad = torch.tensor([1.0, -1.0, 0.0])
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def every_dtype_state() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, name in enumerate(dtypes.DTYPES):
        size = dtypes.itemsize(name)
        if name == "bool":
            t = torch.tensor([True, False, True])
        else:
            raw = bytes((17 * i + 5 * j + 1) % 256 for j in range(3 * size))
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtypes.torch_dtype(name)).clone()
        out[name] = {"vec": t, "scalar": t[1].clone(), "empty": t[:0].clone()}
    return {"dtypes": out}


def nested_values_state() -> dict[str, Any]:
    nan_payload = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0]
    shared = torch.tensor([1.5, -2.5])
    return {
        "tree": {
            "none": None,
            "bools": [True, False],
            "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1],
            "bigints": [2**64, -(2**63) - 1, 2**100],
            "floats": [0.0, -0.0, 0.1, math.inf, nan_payload],
            "text": "héllo",
            "bytes": b"\x00\x01\xfe\xff",
            "tuple": (1, (2, "x")),
            "int_keys": {0: "zero", -7: "neg"},
            "dtype": torch.bfloat16,
            "device": torch.device("cpu"),
            "tied": [shared, shared],
        }
    }


def build(out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    made: list[str] = []
    if True:  # one scope for the helpers below
        def ok(name: str, state_by_part: dict[str, dict[str, Any]], description: str, **kw: Any) -> Path:
            vec = out / name
            shutil.rmtree(vec, ignore_errors=True)
            vec.mkdir()
            ck = vec / STEP_DIR
            if len(state_by_part) == 1 and "rank-00000" in state_by_part:
                _write(ck, state_by_part["rank-00000"], **kw)
            else:
                _write(ck, {}, parts=list(state_by_part.items()), **kw)
            _describe_ok(vec, ck, state_by_part, description)
            made.append(name)
            return ck

        def bad(name: str, mutate: Callable[[Path], str | None], error: str, stage: str, description: str) -> None:
            vec = out / name
            shutil.rmtree(vec, ignore_errors=True)
            vec.mkdir()
            ck = vec / STEP_DIR
            _write(ck, tiny_model_state())
            path = mutate(ck)
            if not isinstance(path, str):
                path = STEP_DIR
            _describe_error(vec, path, error, stage, description)
            made.append(name)

        ok("valid-tiny-model-optim", {"rank-00000": tiny_model_state()},
           "A Linear(4, 3) and its AdamW state after one step with a hand-set gradient.", config={"lr": 0.01, "layers": [4, 3]})
        ok("valid-every-dtype", {"rank-00000": every_dtype_state()},
           "Every dtype of the table: a 3-element vector, a 0-d scalar and an empty tensor each.")
        ok("valid-empty-state", {"rank-00000": {}}, "No state at all: a state file and no tensor file.")
        ok("valid-nested-values", {"rank-00000": nested_values_state()},
           "Plain values of every kind, and one tensor referenced twice (stored once).")
        ok("valid-multi-part-replicated",
           {"rank-00000": {"model": {"w": torch.arange(6, dtype=torch.float32)}, "opt": {"m": torch.zeros(2)}},
            "rank-00001": {"model": writer.Replicated("rank-00000"), "opt": {"m": torch.ones(2)}}},
           "Two parts; rank-00001's model entry is a REPLICA reference to rank-00000's.")

        st = STEP_DIR

        def future_minor(ck: Path) -> None:
            body = _raw_body(ck)
            body["meta"]["added_by_a_minor"] = True
            (ck / MANIFEST_NAME).write_bytes(_hand_manifest(body, minor=9))

        vec = out / "valid-future-minor-version"
        shutil.rmtree(vec, ignore_errors=True)
        vec.mkdir()
        _write(vec / st, tiny_model_state())
        future_minor(vec / st)
        _describe_ok(vec, vec / st, {"rank-00000": tiny_model_state()},
                     "Version 1.9 with an extra key under meta: a 1.0 reader reads it.")
        made.append("valid-future-minor-version")

        def truncate(name: str, keep: int) -> Callable[[Path], None]:
            def f(ck: Path) -> None:
                data = (ck / name).read_bytes()
                (ck / name).write_bytes(data[:keep])
            return f

        bad("invalid-truncated-manifest", truncate(MANIFEST_NAME, 100), "FormatError", "open", "MANIFEST cut to 100 bytes.")
        bad("invalid-truncated-tensor-file", truncate("rank-00000.safetensors", -1), "SizeMismatchError", "open",
            "The tensor file lost its last byte; the manifest size disagrees.")

        def flip_tensor(ck: Path) -> None:
            (n,) = struct.unpack("<Q", (ck / "rank-00000.safetensors").read_bytes()[:8])
            _flip(ck / "rank-00000.safetensors", 8 + n + 5, 3)

        bad("invalid-flipped-bit-tensor-data", flip_tensor, "ChecksumMismatchError", "verify",
            "One bit flipped in the first tensor's data; sizes intact, so only the chunk digest catches it.")
        bad("invalid-flipped-bit-state-file", lambda ck: _flip(ck / "rank-00000.state.msgpack.zst", 20, 0),
            "ChecksumMismatchError", "verify", "One bit flipped in the zstd-compressed state file.")
        bad("invalid-manifest-digest", lambda ck: _flip(ck / MANIFEST_NAME, 40, 1), "ChecksumMismatchError", "open",
            "One bit flipped in the manifest body; its trailing xxh3-128 no longer matches.")
        bad("invalid-wrong-magic", lambda ck: (ck / MANIFEST_NAME).write_bytes(_hand_manifest(_raw_body(ck), magic=b"CKPTMNFX")),
            "FormatError", "open", "Magic CKPTMNFX; digest recomputed so only the magic is wrong.")
        bad("invalid-future-major-version",
            lambda ck: (ck / MANIFEST_NAME).write_bytes(_hand_manifest(None, major=3, body_bytes=b"\xc1 a v3 body")),
            "UnsupportedVersionError", "open", "Major version 3 with a body this reader cannot parse; refused before the body.")

        def absurd_len(ck: Path) -> None:
            data = (ck / MANIFEST_NAME).read_bytes()
            (ck / MANIFEST_NAME).write_bytes(data[:16] + struct.pack("<Q", 1 << 60) + data[24:])

        bad("invalid-absurd-body-length", absurd_len, "LimitExceededError", "open", "Manifest header declares a 2^60-byte body.")

        def rename_file(new: str) -> Callable[[Path], None]:
            def f(ck: Path) -> None:
                body = _raw_body(ck)
                body["parts"][0]["files"][1][0] = new
                (ck / MANIFEST_NAME).write_bytes(_hand_manifest(body))
            return f

        bad("invalid-traversal-name", rename_file("../x"), "UnsafePathError", "open", "A file named ../x in the manifest.")
        bad("invalid-absolute-name", rename_file("/etc/passwd"), "UnsafePathError", "open", "A file named /etc/passwd.")

        def dup_name(ck: Path) -> None:
            body = _raw_body(ck)
            body["parts"][0]["files"][1][0] = body["parts"][0]["files"][0][0]
            (ck / MANIFEST_NAME).write_bytes(_hand_manifest(body))

        bad("invalid-duplicate-file-name", dup_name, "FormatError", "open", "Two file entries with the same name.")
        bad("invalid-missing-file", lambda ck: os.unlink(ck / "rank-00000.safetensors"), "MissingFileError", "open",
            "The tensor file named by the manifest is absent.")
        bad("invalid-extra-file", lambda ck: (ck / "notes.txt").write_text("stray\n"), "UnexpectedFileError", "open",
            "A file the manifest does not name.")

        def no_manifest(ck: Path) -> None:
            os.unlink(ck / MANIFEST_NAME)

        bad("invalid-no-manifest", no_manifest, "IncompleteCheckpointError", "open", "Data files but no MANIFEST: never committed.")

        def tmp_dir(ck: Path) -> str:
            name = ".tmp-step-00000001-000000000000"
            os.rename(ck, ck.parent / name)
            return name

        bad("invalid-uncommitted-temp-dir", tmp_dir, "IncompleteCheckpointError", "open",
            "A complete-looking directory under the temporary prefix: not a checkpoint.")

        def st_header(ck: Path) -> None:
            data = (ck / "rank-00000.safetensors").read_bytes()
            _reseal(ck, "rank-00000.safetensors", struct.pack("<Q", 1 << 60) + data[8:])

        bad("invalid-safetensors-header-absurd", st_header, "LimitExceededError", "verify",
            "The safetensors length prefix claims 2^60 bytes (manifest re-signed to match the file).")

        def tuple_bomb(ck: Path) -> None:
            inner = msgpack.packb([None])
            for _ in range(400):
                inner = msgpack.packb([msgpack.ExtType(EXT_TUPLE, inner)])
            raw = msgpack.packb({"state": {"t": msgpack.ExtType(EXT_TUPLE, inner)}, "context": {}})
            _reseal(ck, "rank-00000.state.msgpack.zst", zstd_compress(raw, 3), raw_size=len(raw))

        bad("invalid-nested-tuple-bomb", tuple_bomb, "LimitExceededError", "verify",
            "A state file of 400 nested tuples (re-signed): above max_nesting.")

        def timestamp_value(ck: Path) -> None:
            raw = msgpack.packb({"state": {"when": msgpack.Timestamp(1, 0)}, "context": {}})
            _reseal(ck, "rank-00000.state.msgpack.zst", zstd_compress(raw, 3), raw_size=len(raw))

        bad("invalid-timestamp-ext", timestamp_value, "FormatError", "verify",
            "A state file holding a msgpack timestamp (ext -1, re-signed): msgpack decodes it without an ext "
            "hook, and a reader must still refuse it.")

        def zstd_lie(ck: Path) -> None:
            frame = struct.pack("<IBQ", 0xFD2FB528, 0b1110_0000, 1 << 29) + b"\x01\x00\x00"
            _reseal(ck, "rank-00000.state.msgpack.zst", frame, raw_size=1 << 29)

        bad("invalid-zstd-size-lie", zstd_lie, "FormatError", "verify",
            "A 14-byte zstd frame claiming 512 MiB of content (manifest agrees): refused without allocating it.")

        # --- strict decoding (§6.1, §7.3, §3) and rules two readers must share (§4, §5.2, §8, §9) ---

        def first_tensor(h: dict[str, Any]) -> str:
            return next(k for k in h if k != "__metadata__")

        def float_shape(h: dict[str, Any]) -> bytes:
            k = first_tensor(h)
            h[k]["shape"] = [float(x) for x in h[k]["shape"]]
            return _padded(h)

        bad("invalid-float-shape", _edit_header(float_shape), "FormatError", "verify",
            "A safetensors shape of floats ([3.0, 4.0]); equal to the ints in Python, refused by §6.1 rule 6.")

        def metadata_not_str(h: dict[str, Any]) -> bytes:
            h["__metadata__"] = {"format": 5}
            return _padded(h)

        bad("invalid-metadata-not-string", _edit_header(metadata_not_str), "FormatError", "verify",
            "__metadata__ maps a key to a number; §6.1 rule 7 wants str to str.")

        def unaligned(h: dict[str, Any]) -> bytes:
            b = json.dumps(h, separators=(",", ":")).encode()
            return b + b" " * ((-len(b) % 8) or 8) + b" "  # one byte past a multiple of 8

        bad("invalid-header-length-unaligned", _edit_header(unaligned), "FormatError", "verify",
            "A safetensors header length that is not a multiple of 8 (tensor offsets re-signed to match).")

        def extra_member_field(h: dict[str, Any]) -> bytes:
            h[first_tensor(h)]["extra"] = 1
            return _padded(h)

        bad("invalid-safetensors-extra-field", _edit_header(extra_member_field), "FormatError", "verify",
            "A tensor member with a fourth field; §6.1 rule 6 allows exactly dtype, shape and data_offsets.")

        def tab_padding(h: dict[str, Any]) -> bytes:
            b = json.dumps(h, separators=(",", ":")).encode()
            return b + b"\t" * (-len(b) % 8 or 8)

        bad("invalid-header-padding-not-spaces", _edit_header(tab_padding), "FormatError", "verify",
            "A header padded with tabs: stock safetensors accepts any JSON whitespace, §6.1 only spaces.")

        def bigint(text: bytes) -> Callable[[Any], None]:
            def e(doc: Any) -> None:
                doc["state"]["n"] = msgpack.ExtType(4, text)
            return e

        bad("invalid-bigint-non-ascii-digits", _edit_state(bigint("١٨٤٤٦٧٤٤٠٧٣٧٠٩٥٥١٦١٦".encode())), "FormatError", "verify",
            "A BIGINT written in Arabic-Indic digits (2^64): Python's int() would accept it; §7.3 wants ASCII.")
        bad("invalid-bigint-in-range", _edit_state(bigint(b"5")), "FormatError", "verify",
            "A BIGINT holding 5: an in-range int has one encoding, a msgpack int (§7.3).")
        bad("invalid-bigint-leading-zeros", _edit_state(bigint(b"018446744073709551616")), "FormatError", "verify",
            "A BIGINT with a leading zero: not the canonical form of §7.3.")

        def name_newline(body: Any) -> None:
            body["parts"][0]["files"][1][0] += "\n"

        bad("invalid-name-trailing-newline", _edit_body(name_newline), "UnsafePathError", "open",
            "A file name ending in a newline: the §3 grammar matches the whole name.")

        def dup_manifest_key(ck: Path) -> None:
            body = _raw_body(ck)
            b = msgpack.packb(body, use_bin_type=True)
            assert 0x80 <= b[0] < 0x8F
            dup = bytes([b[0] + 1]) + b[1:] + msgpack.packb("kind") + msgpack.packb("snapshot")
            _sign_raw(ck, body, body_bytes=dup)

        bad("invalid-duplicate-manifest-key", dup_manifest_key, "FormatError", "open",
            "The MANIFEST body holds 'kind' twice (checkpoint, then snapshot): §2 refuses repeated map keys.")
        bad("invalid-bool-and-int-keys", _edit_state(lambda d: d["state"].update(k="@@KEYS@@"),
                                                     splice=(msgpack.packb("@@KEYS@@"), b"\x82\xc3\xa1T\x01\xa1I")),
            "FormatError", "verify", "A map {true: 'T', 1: 'I'}: bool and int keys equal as values collide (§2).")
        bad("invalid-int-and-float-keys", _edit_state(lambda d: d["state"].update(k="@@KEYS@@"),
                                                      splice=(msgpack.packb("@@KEYS@@"),
                                                              b"\x82\x01\xa1I\xcb" + struct.pack(">d", 1.0) + b"\xa1F")),
            "FormatError", "verify", "A map {1: 'I', 1.0: 'F'}: keys equal as values collide (§2).")

        def wrong_id(body: Any) -> None:
            body["id"] = "0" * 32

        bad("invalid-content-id", _edit_body(wrong_id, fix_id=False), "ChecksumMismatchError", "open",
            "An id that is not the content id of §5.2 (MANIFEST digest re-signed): readers recompute it.")

        def manifest_ext(body: Any) -> None:
            body["meta"]["when"] = msgpack.ExtType(1, b"x")

        bad("invalid-manifest-extension-type", _edit_body(manifest_ext), "FormatError", "open",
            "An extension value inside the MANIFEST's free-form meta: no MANIFEST field may hold one (§4.2).")

        def no_summary(body: Any) -> None:
            del body["parts"][0]["summary"]

        bad("invalid-missing-summary", _edit_body(no_summary), "FormatError", "open",
            "A part map without summary: the key is required, its content free (§4.3).")

        def env_str(doc: Any) -> None:
            doc["context"]["env"] = "linux"

        bad("invalid-context-env-not-a-map", _edit_state(env_str), "FormatError", "verify",
            "context.env is a string; §8 requires a map.")
        bad("invalid-context-missing-extra", _edit_state(lambda d: d["context"].pop("extra")), "FormatError", "verify",
            "context lacks 'extra'; every §8 key is required (nil where absent).")

        def nested_replica(doc: Any) -> None:
            doc["state"]["model"] = {"w": msgpack.ExtType(5, b"rank-00000")}

        bad("invalid-replica-below-entry", _edit_state(nested_replica), "FormatError", "verify",
            "A REPLICA value below a top-level entry: only an entry's whole value may be one (§9).")

        def bad_device(doc: Any) -> None:
            doc["state"]["dev"] = msgpack.ExtType(6, b"gpu:0")

        bad("invalid-device-string", _edit_state(bad_device), "FormatError", "verify",
            "A DEVICE value 'gpu:0' outside the §7.3 device grammar.")

        vec = out / "valid-float32-and-any-directory-name"
        shutil.rmtree(vec, ignore_errors=True)
        vec.mkdir()
        _write(vec / STEP_DIR, {"x": {"half": 0.5}})
        ck32 = vec / "saved by hand (1)"  # writers refuse this name (§3); readers do not look (§11)
        os.rename(vec / STEP_DIR, ck32)
        doc = _state_doc(ck32)
        raw = msgpack.packb(doc, use_bin_type=True)
        f64 = b"\xcb" + struct.pack(">d", 0.5)
        assert raw.count(f64) == 1
        _put_state(ck32, raw.replace(f64, b"\xca" + struct.pack(">f", 0.5)))
        _describe_ok(vec, ck32, {"rank-00000": {"x": {"half": 0.5}}},
                     "A float32 (0xca) in the state document decodes to the same float64; the directory name is "
                     "outside the §3 grammar, which readers do not check (§11).")
        made.append(vec.name)
    return made


def main(argv: list[str] | None = None, *, builder: Callable[[Path], list[str]] | None = None, default: str = "checkpoint") -> int:
    import warnings

    warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else HERE / default
    made = (builder or build)(out)
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{len(made)} vectors, {total} bytes in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
