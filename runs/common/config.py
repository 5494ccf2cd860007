"""The reference runs' configuration records: one way to put a frozen dataclass on the
tape and to read it back.

A run's config is taped in the tape's metadata (``{"diloco": cfg.to_dict()}``), which goes
through msgpack: tuples come back as lists and nested records as maps. :class:`Record`
gives every run's config the same three methods: ``to_dict`` (plain lists and dicts),
``from_dict`` (refuses unknown keys, naming them; rebuilds tuples and nested records from
the fields' annotations) and ``with_`` (a changed copy). Scalars are taken as they come,
so a value reads back exactly as it was written.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Mapping

__all__ = ["Record"]


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _coerce(tp: Any, v: Any, *, inside: bool = False) -> Any:
    """``v`` (as msgpack gave it back) as the annotation ``tp`` wants it: tuples for
    tuples, records for records, dicts for mappings. A field's own scalar is kept as it
    came; a scalar inside a tuple is made the element type (``(str, int)`` pairs)."""
    if v is None:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        real = [a for a in args if a is not type(None)]
        return _coerce(real[0], v, inside=inside) if len(real) == 1 else v
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], x, inside=True) for x in v)
        return tuple(_coerce(a, x, inside=True) for a, x in zip(args, v)) if args else tuple(v)
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return dict(v)
    if dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        return tp(**{k: _coerce(hints[k], x) for k, x in dict(v).items()})
    if inside and tp in (int, float, str, bool):
        return tp(v)
    return v


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # each class's annotations in its own module's names


class Record:
    """Mixin for a run's frozen config dataclass (``what`` names it in errors)."""

    __slots__ = ()
    what: typing.ClassVar[str] = "config"

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"unknown {cls.what} keys: {unknown}")
        hints = _hints(cls)
        return cls(**{k: _coerce(hints[k], v) for k, v in d.items()}).checked()

    def checked(self) -> Any:
        """What ``from_dict`` also checks beyond ``__post_init__`` (a run's hook); ``self``."""
        return self

    def with_(self, **changes: Any) -> Any:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]
