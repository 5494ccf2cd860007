"""The standard safetensors layout, written and checked by us (pure; no torch).

We write the file ourselves rather than through ``safetensors.save_file`` so that
bytes stream straight from tensor memory through the chunk hasher to the disk, with
no second pass and no intermediate copy. The result is a stock safetensors file:
``u64 header length | JSON header (space-padded to 8) | data``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import FormatError, LimitExceededError
from ..knobs import knobs
from . import dtypes

__all__ = ["TensorSlot", "build_header", "parse_header", "check_against_manifest"]


@dataclass(frozen=True, slots=True)
class TensorSlot:
    key: str
    dtype: str  # our dtype name
    shape: tuple[int, ...]
    nbytes: int


def build_header(slots: Sequence[TensorSlot], metadata: dict[str, str] | None = None) -> tuple[bytes, list[int]]:
    """Return (header bytes incl. the 8-byte length prefix, absolute data offsets)."""
    return build_header_rows([(s.key, s.dtype, s.shape, s.nbytes) for s in slots], metadata)


_encode_str = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]


def build_header_rows(
    rows: Sequence[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[int]]:
    """``build_header`` from ``(key, dtype name, shape, nbytes)`` rows.

    The JSON is assembled as text, byte for byte what ``json.dumps(header,
    separators=(",", ":"), ensure_ascii=True)`` gives for the same dict (a test checks
    it): building one dict per tensor and encoding it costs 4x more, which a state of
    thousands of small tensors pays on every save.
    """
    pieces = []
    if metadata:
        pieces.append('"__metadata__":' + json.dumps(dict(metadata), separators=(",", ":"), ensure_ascii=True))
    pos = 0
    rel = []
    names: dict[str, tuple[str, bool]] = {}  # dtype -> (safetensors name, stored as raw bytes)
    for key, dtype, shape, nbytes in rows:
        got = names.get(dtype)
        if got is None:
            got = names[dtype] = (dtypes.safetensors_name(dtype), dtypes.is_raw(dtype))
        st, as_raw = got
        dims = str(nbytes) if as_raw else ",".join(map(str, shape))
        end = pos + nbytes
        pieces.append(f'{_encode_str(key)}:{{"dtype":"{st}","shape":[{dims}],"data_offsets":[{pos},{end}]}}')
        rel.append(pos)
        pos = end
    text = "{" + ",".join(pieces) + "}"
    data = text.encode("ascii")
    data += b" " * (-len(data) % 8)  # safetensors pads the header with spaces to 8 bytes
    start = 8 + len(data)
    return struct.pack("<Q", len(data)) + data, [start + r for r in rel]


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # JSON allows repeated keys (last one wins); two readers could then disagree on
    # which bytes a tensor is, so a repeated key is a format error.
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


_MEMBER_KEYS = frozenset(("dtype", "shape", "data_offsets"))


def _is_int(v: Any) -> bool:
    return type(v) is int  # json gives int, float or bool; only int is an int here


def parse_header(prefix: bytes, file_size: int, *, path: str | None = None) -> tuple[int, dict[str, Any]]:
    """Parse ``prefix`` = the first 8 bytes, then call again with the header bytes.

    Returns (header_length, header dict). Raises before allocating for absurd sizes.
    Decoding is strict (spec §6.1 "Header decoding"): the length is a multiple of 8,
    the JSON object starts at the first byte and only spaces follow it, no key repeats,
    every tensor member has exactly ``dtype`` (str), ``shape`` (array of int) and
    ``data_offsets`` (two ints), and ``__metadata__`` maps str to str.
    """
    if len(prefix) < 8:
        raise FormatError("safetensors file shorter than its 8-byte length prefix", path=path, offset=len(prefix))
    (n,) = struct.unpack_from("<Q", prefix, 0)
    limit = knobs().max_safetensors_header
    if n > limit:
        raise LimitExceededError(f"safetensors header claims {n} bytes, above the limit {limit}", path=path, offset=0)
    if 8 + n > file_size:
        raise FormatError(f"safetensors header claims {n} bytes but the file has {file_size}", path=path, offset=0)
    if n % 8 or n == 0:
        raise FormatError(f"safetensors header length {n} is not a positive multiple of 8", path=path, offset=0)
    if len(prefix) < 8 + n:
        return n, {}
    try:
        text = str(memoryview(prefix)[8 : 8 + n], "utf-8")
        if not text.startswith("{"):
            raise json.JSONDecodeError("the header must start with '{'", text, 0)
        header, end = json.JSONDecoder(object_pairs_hook=_no_duplicates).raw_decode(text)
    except _DuplicateKey as e:
        raise FormatError(f"safetensors header repeats the key {e.args[0]!r}", path=path, offset=8) from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, int digit limit, nesting
        raise FormatError(f"safetensors header is not valid JSON: {type(e).__name__}: {str(e)[:200]}", path=path, offset=8) from None
    if text[end:].strip(" "):
        raise FormatError("safetensors header has bytes other than spaces after its JSON object", path=path, offset=8 + end)
    if not isinstance(header, dict):
        raise FormatError("safetensors header is not a JSON object", path=path, offset=8)
    for key, h in header.items():
        if key == "__metadata__":
            if not isinstance(h, dict) or not all(isinstance(v, str) for v in h.values()):
                raise FormatError("safetensors __metadata__ must map strings to strings", path=path, offset=8)
            continue
        if not isinstance(h, dict) or set(h) != _MEMBER_KEYS:
            raise FormatError("a safetensors member must have exactly dtype, shape and data_offsets", path=path, offset=8, key=key)
        shape, off = h["shape"], h["data_offsets"]
        if (
            not isinstance(h["dtype"], str)
            or not isinstance(shape, list)
            or not all(_is_int(d) and d >= 0 for d in shape)
            or not isinstance(off, list)
            or len(off) != 2
            or not all(_is_int(o) and o >= 0 for o in off)
        ):
            raise FormatError("safetensors member has a malformed dtype, shape or data_offsets", path=path, offset=8, key=key)
    return n, header


def check_against_manifest(
    header: dict[str, Any],
    header_len: int,
    file_size: int,
    entries: Sequence[Any],
    *,
    path: str | None = None,
    shared: bool = False,
) -> None:
    """The safetensors header and the manifest's tensor table must describe the same bytes.

    Also enforces safetensors' own rule: data regions tile the buffer with no holes
    and no overlaps. ``shared`` (a file this checkpoint shares from the one that wrote it,
    format-2.md §V.2.4): the header may have members no entry references (that
    checkpoint's other tensors); they must still tile the data region.
    """
    start = 8 + header_len
    names = [k for k in header if k != "__metadata__"]
    if len(names) != len(entries) and not (shared and len(names) > len(entries)):
        raise FormatError(
            f"safetensors header lists {len(names)} tensors, manifest {len(entries)}", path=path, offset=8
        )
    for e in entries:
        h = header.get(e.key)
        if not isinstance(h, dict):
            raise FormatError("tensor missing from safetensors header", path=path, key=e.key, offset=8)
        want_shape = [e.nbytes] if dtypes.is_raw(e.dtype) else list(e.shape)
        off = h.get("data_offsets")
        if (
            h.get("dtype") != dtypes.safetensors_name(e.dtype)
            or h.get("shape") != want_shape
            or not isinstance(off, list)
            or len(off) != 2
            or off != [e.offset - start, e.offset - start + e.nbytes]
        ):
            raise FormatError("safetensors header disagrees with the manifest", path=path, key=e.key, offset=8)
    spans = []
    for k in names:
        b, end = header[k]["data_offsets"]
        if end < b:
            raise FormatError("safetensors member ends before it begins", path=path, key=k, offset=8)
        spans.append((b, end))
    spans.sort()
    pos = 0
    for b, end in spans:
        if b != pos:
            raise FormatError(f"hole or overlap in safetensors data at {start + pos}", path=path, offset=start + pos)
        pos = end
    if start + pos != file_size:
        raise FormatError(
            f"safetensors data ends at {start + pos} but the file has {file_size} bytes", path=path, offset=start + pos
        )
