"""xxh3-128 digests of tensors, parameters, RNG states and payloads; the environment diff.

The config hash and the environment fingerprint a tape carries are ckpt's
(``ckpt.context``), so a checkpoint and a tape of one run agree on both.

torch and numpy are imported lazily, so the tape tools (``ckpt tape ...``) stay torch-free.
A tensor digest covers the dtype name, the shape and the raw bytes in C order, so a
reshape or a dtype change is a different digest even when the bytes agree.
"""

from __future__ import annotations

import struct
import sys
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import msgpack
import xxhash

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["bytes_digest", "tensor_digest", "named_digests", "module_digests", "rng_digests", "payload_digest",
           "env_diff", "RNG_SOURCES"]

_DTYPE_NAMES: dict[str, str] = {}  # torch dtype repr -> stable name; filled on first use


def _dtype_name(dtype: "torch.dtype") -> str:
    if not _DTYPE_NAMES:
        import torch

        for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
                     "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32",
                     "uint64"):
            dt = getattr(torch, name, None)
            if dt is not None:
                _DTYPE_NAMES[repr(dt)] = name
    try:
        return _DTYPE_NAMES[repr(dtype)]
    except KeyError:
        raise ValueError(f"no stable digest name for dtype {dtype!r}") from None


def bytes_digest(data: bytes | bytearray | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data)


def tensor_digest(t: "torch.Tensor") -> bytes:
    """16-byte xxh3-128 of dtype, shape and the tensor's bytes (moved to CPU if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    h = xxhash.xxh3_128()
    h.update(_dtype_name(t.dtype).encode())
    h.update(struct.pack(f"<{t.dim()}q", *t.shape))
    if t.numel():
        h.update(t.contiguous().reshape(-1).view(_u8()).numpy().data)
    return h.digest()


def _u8() -> Any:
    import torch

    return torch.uint8


def named_digests(named: Iterable[tuple[str, "torch.Tensor"]]) -> tuple[bytes, list[tuple[str, bytes]]]:
    """(digest of all, per-tensor digests) for (name, tensor) pairs in the given order."""
    per = [(name, tensor_digest(t)) for name, t in named]
    h = xxhash.xxh3_128()
    for name, d in per:
        h.update(name.encode())
        h.update(b"\0")
        h.update(d)
    return h.digest(), per


def module_digests(module: "torch.nn.Module", prefix: str = "") -> tuple[bytes, list[tuple[str, bytes]]]:
    """Digests of a module's state_dict entries (parameters and persistent buffers)."""
    return named_digests((prefix + k, v) for k, v in module.state_dict(keep_vars=True).items())


RNG_SOURCES = ("torch", "cuda", "python", "numpy")


def rng_digests(sources: Iterable[str] = RNG_SOURCES) -> list[tuple[str, bytes]]:
    """Digests of the process-wide RNG states named in ``sources``: ``torch`` (CPU),
    ``cuda`` (each initialized device), ``python`` (``random``) and ``numpy`` (the legacy
    global generator, when numpy is imported). An unseeded generator differs between
    processes, so either seed it or leave it out of ``sources``."""
    import random

    import torch

    want = set(sources)
    out = []
    if "torch" in want:
        # The CPU generator state is a flat uint8 tensor: digest its bytes directly
        # (tensor_digest's dtype/shape framing would cost 7x more, every step).
        out.append(("torch", xxhash.xxh3_128_digest(torch.get_rng_state().numpy().data)))
    if "cuda" in want and torch.cuda.is_available() and torch.cuda.is_initialized():  # pragma: no cover - no CUDA
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out.append((f"torch.cuda:{i}", tensor_digest(s)))
    if "python" in want:
        version, internal, gauss = random.getstate()
        out.append(("python", xxhash.xxh3_128_digest(
            struct.pack(f"<{len(internal)}I", *internal) + msgpack.packb([version, gauss]))))
    np = sys.modules.get("numpy")
    if "numpy" in want and np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out.append(("numpy", xxhash.xxh3_128_digest(keys.tobytes() + struct.pack("<iid", pos, has_gauss, cached))))
    return out


def payload_digest(obj: Any) -> bytes:
    """Digest of a message payload: bytes, a tensor, a mapping of those, or msgpack-able data."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return xxhash.xxh3_128_digest(obj)
    if type(obj).__module__.startswith("torch") and hasattr(obj, "dtype"):
        return tensor_digest(obj)
    if isinstance(obj, Mapping):
        h = xxhash.xxh3_128()
        for k in sorted(obj):
            h.update(str(k).encode())
            h.update(b"\0")
            h.update(payload_digest(obj[k]))
        return h.digest()
    return xxhash.xxh3_128_digest(msgpack.packb(obj, use_bin_type=True, use_single_float=False))


def env_diff(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Keys whose values differ: key -> (recorded, current); a missing side is None."""
    return {k: (recorded.get(k), current.get(k)) for k in sorted(set(recorded) | set(current))
            if recorded.get(k) != current.get(k)}
