"""xxh3-128 digests of tensors, parameters, RNG states and payloads.

The config hash, the environment fingerprint and the environment comparison a tape uses
are ckpt's (``ckpt.context``: ``config_hash``, ``capture_env``, ``env_diff``), so a
checkpoint and a tape of one run agree on all three.

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

__all__ = ["bytes_digest", "tensor_digest", "named_digests", "state_digest", "module_digests", "rng_digests",
           "payload_digest", "RNG_SOURCES"]

# One tensor digest in the repository: ckpt.context.digest (ckpt lives below replay).
from ckpt.context.digest import bytes_digest, tensor_digest  # noqa: E402,F401


def named_digests(named: Iterable[tuple[str, "torch.Tensor"]]) -> tuple[bytes, list[tuple[str, bytes]]]:
    """(digest of all, per-tensor digests) for (name, tensor) pairs in the given order."""
    per = [(name, tensor_digest(t)) for name, t in named]
    h = xxhash.xxh3_128()
    for name, d in per:
        h.update(name.encode())
        h.update(b"\0")
        h.update(d)
    return h.digest(), per


def state_digest(named: Iterable[tuple[str, "torch.Tensor"]]) -> bytes:
    """One digest of a state given as (name, tensor) pairs, in order: the ``digest`` of
    the ``params`` event those pairs would tape (names, dtypes, shapes and bytes)."""
    return named_digests(named)[0]


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
