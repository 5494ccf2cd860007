"""The state digests live in :mod:`ckpt.context.digest` (the guard and bisect use them
too); this path is kept one release and hands on the same names."""

from __future__ import annotations

from ..context.digest import (  # noqa: F401 - re-exported
    batch_digest, bytes_digest, dtype_name, params_digest, rng_digests, tensor_digest,
)

__all__ = ["bytes_digest", "tensor_digest", "batch_digest", "rng_digests", "params_digest", "dtype_name"]
