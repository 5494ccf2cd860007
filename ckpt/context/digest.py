"""xxh3-128 digests of the training state: batches, RNG streams, parameters, tensors.

The step ledger records them, the loss guard proves with them that a routing warm-up moved
no RNG stream, and ``ckpt.bisect`` traces with them: here, beside the RNG capture they
name, so that none of those imports another for a digest.

A tensor digest covers the dtype name, the shape (i64 LE) and the raw bytes in C order
(spec/tape-format.md §6.2), so a reshape or dtype change is a different digest even
when the bytes agree. ``replay.digest`` re-exports ``tensor_digest``/``bytes_digest``
from here: one tensor digest in the repository.
"""

from __future__ import annotations

import random
import struct
import sys
from typing import Any, Iterable, Mapping

import xxhash

__all__ = ["bytes_digest", "tensor_digest", "batch_digest", "rng_digests", "params_digest", "dtype_name"]

_DTYPE_NAMES: dict[str, str] = {}  # torch dtype repr -> stable name; filled on first use


def dtype_name(dtype: Any) -> str:
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


def _update_tensor(h: Any, t: Any) -> None:
    import torch

    t = t.detach()
    if callable(getattr(t, "to_local", None)):  # a DTensor (FSDP2, TP): this rank's shard, in its rank's ledger
        t = t.to_local()
    if t.device.type != "cpu":
        t = t.cpu()
    h.update(dtype_name(t.dtype).encode())
    h.update(struct.pack(f"<{t.dim()}q", *t.shape))
    if t.numel():
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def tensor_digest(t: Any) -> bytes:
    """16-byte xxh3-128 of dtype, shape and the tensor's bytes (moved to CPU if needed)."""
    h = xxhash.xxh3_128()
    _update_tensor(h, t)
    return h.digest()


def batch_digest(batch: Any) -> bytes:
    """One digest of every tensor in a batch: a tensor, or tuples/lists/dicts of them
    (dict keys sorted; other leaves by their ``repr``, e.g. ints and strings)."""
    h = xxhash.xxh3_128()
    _walk(h, batch)
    return h.digest()


def _walk(h: Any, v: Any) -> None:
    if hasattr(v, "dtype") and hasattr(v, "detach") and hasattr(v, "shape"):
        h.update(b"T")
        _update_tensor(h, v)
    elif isinstance(v, Mapping):
        h.update(b"{%d" % len(v))
        for k in sorted(v, key=str):
            h.update(str(k).encode() + b"\0")
            _walk(h, v[k])
    elif isinstance(v, (list, tuple)):
        h.update(b"[%d" % len(v))
        for x in v:
            _walk(h, x)
    elif hasattr(v, "tobytes") and hasattr(v, "dtype"):  # numpy array
        h.update(b"N" + str(v.dtype).encode() + struct.pack(f"<{v.ndim}q", *v.shape))
        h.update(v.tobytes())
    else:
        h.update(b"R" + repr(v).encode())


def rng_digests(generators: Mapping[str, Any] | None = None) -> list[tuple[str, bytes]]:
    """Digests of every stream a checkpoint captures (``ckpt.context.rng``), by the same
    names: ``python``, ``numpy`` (when imported), ``torch_cpu``, ``cuda:N`` (each
    device, only once CUDA is initialised) and ``generator:NAME``."""
    import torch

    version, internal, gauss = random.getstate()
    out = [("python", xxhash.xxh3_128_digest(struct.pack(f"<{len(internal)}I", *internal) + repr(gauss).encode()))]
    np = sys.modules.get("numpy")
    if np is not None:
        _, keys, pos, has_gauss, cached = np.random.get_state()
        out.append(("numpy", xxhash.xxh3_128_digest(keys.tobytes() + struct.pack("<iid", pos, has_gauss, cached))))
    out.append(("torch_cpu", xxhash.xxh3_128_digest(torch.get_rng_state().numpy().data)))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out.append((f"cuda:{i}", xxhash.xxh3_128_digest(s.numpy().data)))
    for name, gen in (generators or {}).items():
        out.append((f"generator:{name}", xxhash.xxh3_128_digest(gen.get_state().numpy().data)))
    return out


def params_digest(named: Iterable[tuple[str, Any]]) -> bytes:
    """xxh3-128 over ``name NUL tensor-digest`` per entry, in order (the ``params`` rule)."""
    h = xxhash.xxh3_128()
    for name, t in named:
        h.update(name.encode() + b"\0")
        h.update(tensor_digest(t))
    return h.digest()
