"""The persisted dtype table. Never write ``str(torch.float32)``: names here are the contract.

Each row: our name (persisted), the safetensors dtype used in the tensor file, and the
element size. Dtypes stock safetensors has no name for are stored as ``U8`` byte
arrays (shape ``[nbytes]``); our manifest keeps the true dtype and shape, so stock
readers still get the bytes and our reader restores the tensor exactly.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DTYPES", "itemsize", "safetensors_name", "torch_dtype", "dtype_name"]

# name: (safetensors dtype, itemsize in bytes)
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint64": ("U64", 8),
    "uint32": ("U32", 4),
    "uint16": ("U16", 2),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e4m3fnuz": ("F8_E4M3FNUZ", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "float8_e5m2fnuz": ("F8_E5M2FNUZ", 1),
    "complex64": ("C64", 8),
    # No stock safetensors name: stored as raw U8 bytes.
    "complex128": ("U8", 16),
    "complex32": ("U8", 4),
    "float8_e8m0fnu": ("U8", 1),
    "float4_e2m1fn_x2": ("U8", 1),
    "bits8": ("U8", 1),
    "bits16": ("U8", 2),
}


def itemsize(name: str) -> int:
    return DTYPES[name][1]


def safetensors_name(name: str) -> str:
    return DTYPES[name][0]


def is_raw(name: str) -> bool:
    """True when the tensor file holds the bytes as a flat U8 array."""
    return DTYPES[name][0] == "U8" and name != "uint8"


_NAMES: dict[Any, str] = {}  # torch.dtype -> name, filled on first use (str(dtype) per tensor adds up)


def dtype_name(dtype: Any) -> str:
    """torch.dtype -> persisted name; raises KeyError for dtypes we cannot store."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):
        pass
    text = str(dtype)
    name = text[len("torch.") :] if text.startswith("torch.") else text
    if name not in DTYPES:
        raise KeyError(name)
    try:
        _NAMES[dtype] = name
    except TypeError:  # an unhashable stand-in: just do not cache it
        pass
    return name


def torch_dtype(name: str) -> Any:
    import torch

    if name not in DTYPES:
        raise KeyError(name)
    return getattr(torch, name)
