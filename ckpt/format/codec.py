"""Bounded msgpack and zstd helpers shared by every structure file.

msgpack's own limits guard container sizes; ``max_nesting`` guards recursion in our
extension hook (tuples nest through ext payloads, which msgpack cannot see).
"""

from __future__ import annotations

from typing import Any, Callable

import msgpack
import zstandard

from ..errors import FormatError, LimitExceededError
from ..knobs import knobs

__all__ = ["packb", "unpackb", "ContainerBudget", "ContainerLimitError", "bounded", "value_limit", "zstd_compress", "zstd_decompress", "foreign_value", "strict_map", "DuplicateKeyError"]


def packb(obj: Any) -> bytes:
    # Callers hand in values already converted by format/tree.to_wire, which turns
    # tuples and library types into explicit extension types before packing.
    return msgpack.packb(obj, use_bin_type=True, strict_types=False)


def foreign_value(obj: Any) -> str | None:
    """The key path of the first value that plain msgpack data cannot hold, or None.

    msgpack decodes extension type -1 (Timestamp) itself, without calling any
    ``ext_hook``, and hands unknown extension types back as ``ExtType`` when no hook is
    given. Neither is a value our formats write, so a document holding one is corrupt or
    crafted; callers raise their own error naming the path. Iterative, so a deep
    document cannot exhaust the stack."""
    if not _has_foreign(obj):
        return None  # the common case, without building a path string per value
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        v, where = stack.pop()
        t = type(v)
        if t is msgpack.Timestamp or t is msgpack.ExtType:
            return where or "/"
        if t is dict:
            for k, x in v.items():
                if type(k) is msgpack.Timestamp or type(k) is msgpack.ExtType:
                    return f"{where}/<key>"
                stack.append((x, f"{where}/{k}"))
        elif t is list or t is tuple:
            stack.extend((x, f"{where}/{i}") for i, x in enumerate(v))
    return None


_FOREIGN = (msgpack.Timestamp, msgpack.ExtType)


def _has_foreign(obj: Any) -> bool:
    """Whether ``obj`` holds a Timestamp or ExtType anywhere (a MANIFEST of thousands of
    part references is walked in milliseconds this way)."""
    stack = [obj]
    pop, push, extend = stack.pop, stack.append, stack.extend
    while stack:
        v = pop()
        t = type(v)
        if t is dict:
            for k in v:
                if type(k) in _FOREIGN:
                    return True
            extend(v.values())
        elif t is list or t is tuple:
            extend(v)
        elif t in _FOREIGN:
            return True
    return False


class DuplicateKeyError(ValueError):
    """Raised inside msgpack's pairs hook; callers turn it into their own FormatError."""


def strict_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """msgpack ``object_pairs_hook``: build a map, refusing keys that collide.

    A plain decode lets the last of two equal keys win, silently, and Python's
    equality merges ``true``/``1``, ``1``/``1.0`` and ``0.0``/``-0.0``; two readers
    could then disagree on a document's meaning. Spec (checkpoint §7.3, "Map keys"):
    keys equal as values are duplicates and refused, and so are NaN keys (never equal
    to themselves, so no lookup could find them)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: dict[Any, Any] = {}
        for k, _ in pairs:
            if k in seen:
                raise DuplicateKeyError(f"map repeats the key {k!r} (as {seen[k]!r}); keys equal as values are duplicates")
            seen[k] = k
    for k in out:
        if type(k) is float and k != k:
            raise DuplicateKeyError("map has a NaN key")
    return out


class ContainerBudget:
    """How many more arrays and maps a decode may build (``Knobs.max_containers``).

    msgpack's own limits bound each container's *length* by the input, not how many
    containers the input makes: one byte (``0x90``) is an empty array, a Python list of
    56 bytes plus its slot, so 16 MiB of them made 3.6 GiB. Every other value costs at
    least one input byte and a bounded object, so with this count capped, decoding
    ``n`` bytes holds at most a small multiple of ``n`` plus ``max_containers`` lists
    (spec/checkpoint-format.md §14). One budget may span several decodes of one
    document (tuple payloads decode separately)."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int | None = None) -> None:
        self.limit = knobs().max_containers if limit is None else limit
        self.left = self.limit

    def take(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise ContainerLimitError(self.limit)


class ContainerLimitError(ValueError):
    """Raised inside msgpack's hooks when a decode passes its ``ContainerBudget``.
    ``unpackb`` turns it into ``LimitExceededError``; the tape and stream decoders into
    their own limit errors. A ValueError, so a caller that treats every decode failure
    alike still catches it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"more than {limit} arrays and maps in one msgpack document")


def value_limit(file_bytes: int) -> int:
    """The longest str, bin or ext value a structure file of ``file_bytes`` on disk may
    hold (spec/checkpoint-format.md §7.1): ``Knobs.value_ratio`` times the file, and at
    least ``Knobs.value_floor``. Decoding copies each such value out of the decompressed
    document, so without it a 68 KiB zstd frame holding one 1 GiB bin held 2 GiB."""
    k = knobs()
    return max(k.value_ratio * file_bytes, k.value_floor)


def bounded(n: int, *, pairs: Callable[[list[tuple[Any, Any]]], Any] | None = None,
            budget: ContainerBudget | None = None, max_value: int | None = None) -> dict[str, Any]:
    """``msgpack.unpackb`` keyword arguments that bound a decode of ``n`` input bytes:
    no container, string or bin longer than the input (nor above the knobs), and at
    most ``budget`` arrays and maps built (``Knobs.max_containers`` by default).
    ``pairs``: the map builder (``strict_map`` by default); ``max_value``: the longest
    str, bin or ext value (:func:`value_limit`), besides the input length."""
    k = knobs()
    longest = min(n, k.max_state_raw_bytes, max_value if max_value is not None else n)
    b = budget if budget is not None else ContainerBudget()
    take = b.take
    build = pairs if pairs is not None else strict_map

    def list_hook(v: list[Any]) -> list[Any]:
        take()
        return v

    def pairs_hook(items: list[tuple[Any, Any]]) -> Any:
        take()
        return build(items)

    return dict(
        max_str_len=longest,
        max_bin_len=longest,
        max_array_len=min(n, k.max_container_len),
        max_map_len=min(n // 2 + 1, k.max_container_len),
        max_ext_len=longest,
        list_hook=list_hook,
        object_pairs_hook=pairs_hook,
    )


def unpackb(
    data: bytes | memoryview,
    *,
    path: str | None = None,
    what: str = "msgpack",
    ext_hook: Callable[[int, bytes], Any] | None = None,
    offset: int = 0,
    budget: ContainerBudget | None = None,
    max_value: int | None = None,
) -> Any:
    """``offset``: where the document starts in its file, named by errors. Inside a
    compressed file positions do not map to file bytes, so errors name the frame (0).
    ``budget``: the containers the document may still build (a fresh one by default)."""
    b = budget if budget is not None else ContainerBudget()
    kwargs: dict[str, Any] = dict(raw=False, strict_map_key=False, use_list=True, **bounded(len(data), budget=b, max_value=max_value))
    if ext_hook is not None:
        kwargs["ext_hook"] = ext_hook
    try:
        out = msgpack.unpackb(data, **kwargs)
    except ContainerLimitError:
        raise LimitExceededError(f"{what} builds more than {b.limit} arrays and maps (Knobs.max_containers)",
                                 path=path, offset=offset) from None
    except (FormatError, RecursionError) as e:
        if isinstance(e, RecursionError):
            raise LimitExceededError(f"{what} nests too deeply", path=path, offset=offset) from None
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise FormatError(f"malformed {what}: {e}", path=path, offset=offset) from None
    bad = foreign_value(out)
    if bad is not None:
        raise FormatError(f"{what} holds a msgpack extension value at {bad} (timestamp or unknown type)",
                          path=path, offset=offset)
    return out


def zstd_compress(data: bytes, level: int | None = None) -> bytes:
    lvl = knobs().zstd_level if level is None else level
    # write_content_size lets a reader know the output size before decompressing.
    return zstandard.ZstdCompressor(level=lvl, write_content_size=True, write_checksum=False).compress(data)


def zstd_decompress(data: bytes, raw_size: int, *, path: str | None = None) -> bytearray:
    limit = knobs().max_state_raw_bytes
    if raw_size < 0 or raw_size > limit:
        raise LimitExceededError(f"declared raw size {raw_size} exceeds the limit {limit}", path=path, offset=0)
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise FormatError(f"malformed zstd frame: {e}", path=path, offset=0) from None
    if params.content_size != raw_size:
        raise FormatError(
            f"zstd frame declares {params.content_size} bytes, manifest says {raw_size}", path=path, offset=0
        )
    # Memory follows the bytes that really come out of the frame, never the declared
    # size alone: an 18-byte frame claiming 1 GiB costs nothing before failing. The first
    # _GROW_LIMIT bytes grow a buffer step by step; a frame that really produces more is
    # moved once into a buffer of the declared size (calloc'd: pages are touched only as
    # bytes arrive). The buffer is returned as is: no bytes() copy, which doubled the
    # peak for a legitimate large document (spec §7.1, §14).
    out = bytearray()
    filled = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=False) as reader:
            while filled <= raw_size and filled < _GROW_LIMIT:
                chunk = reader.read(min(1 << 20, raw_size + 1 - filled))
                if not chunk:
                    break
                out += chunk
                filled = len(out)
            if filled >= _GROW_LIMIT and filled <= raw_size:
                big = bytearray(raw_size + 1)
                big[:filled] = out
                out = big
                view = memoryview(out)
                try:
                    while filled <= raw_size:
                        got = reader.readinto(view[filled : filled + min(1 << 20, raw_size + 1 - filled)])
                        if not got:
                            break
                        filled += got
                finally:
                    view.release()
    except zstandard.ZstdError as e:
        raise FormatError(f"malformed zstd data: {e}", path=path, offset=0) from None
    if filled != raw_size:
        raise FormatError(f"zstd output is {filled} bytes, expected {raw_size}", path=path, offset=0)
    del out[raw_size:]  # the probe byte (and the spare capacity) go in place
    return out


_GROW_LIMIT = 32 << 20
