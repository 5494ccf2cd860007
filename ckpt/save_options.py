"""``SaveOptions``: how a checkpoint is written, declared once.

Every save path takes the same frozen record and passes it on unchanged: ``ckpt.save``,
``ckpt.write_part``, ``DistributedCheckpointer.save``, the sharded save
(``ckpt.dcp.integration.save_sharded``) and ``CheckpointManager``. Each path states once
which options it supports (a ``frozenset`` of field names beside it) and refuses any other
option given a non-default value with :class:`~ckpt.errors.SaveOptionError`, naming the
option and the path, before anything is written. An option is never silently dropped.

The keyword arguments of those functions (``compress=``, ``dedup=``, ...) remain: they
build the record (:func:`options_from`), and may be mixed with ``options=`` as long as
the two do not disagree.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .errors import SaveOptionError

if TYPE_CHECKING:  # pragma: no cover
    from ._partfiles import Reuse

__all__ = ["SaveOptions", "options_from", "OPTION_NAMES"]

#: ``compress=`` of a save: off, every float tensor, the tensors under these top-level
#: entries, or a callable ``(key, dtype name, nbytes) -> bool``
Compress = bool | Sequence[str] | Callable[[str, str, int], bool] | None


@dataclass(frozen=True, slots=True)
class SaveOptions:
    """How a save is written (what is saved is the call's other arguments).

    ``overwrite``: replace a committed checkpoint of the same name (atomically).
    ``compress``: encode tensors (format 2.0, BPZ1 + zstd): ``True`` for every float tensor
    of at least 64 KiB, a list of top-level entry names, or ``(key, dtype, nbytes) -> bool``.
    ``dedup``: record a digest of every tensor, so that a later save can share this one's
    files. ``dedup_from``: an earlier checkpoint of the same run directory whose unchanged
    files are shared, not written (implies ``dedup``). ``reuse``: the same, as the part of
    that checkpoint to share from (``ckpt.writer.reuse_from``; one part's writer).
    ``part_manifests``: list parts by reference (format 2.0 §V.5; default by world size).
    ``this_rank_only``: one rank of a process group saves its own state alone.
    """

    overwrite: bool = False
    compress: Compress = None
    dedup: bool = False
    dedup_from: str | os.PathLike[str] | None = None
    reuse: Reuse | None = None
    part_manifests: bool | None = None
    this_rank_only: bool = False

    def given(self) -> tuple[str, ...]:
        """The options set to something other than their default, in field order."""
        return tuple(f.name for f in dataclasses.fields(self) if _is_set(f.name, getattr(self, f.name), f.default))

    def refuse_unsupported(self, supported: frozenset[str], where: str, why: str, *, path: str | None = None) -> None:
        """``SaveOptionError`` naming every option given that ``where`` does not support."""
        bad = [n for n in self.given() if n not in supported]
        if bad:
            names = ", ".join(f"{n}={getattr(self, n)!r}" for n in bad)
            raise SaveOptionError(
                f"{where} does not support {names}: {why}; nothing was written",
                path=path, options=bad, supports=sorted(supported),
            )


def _is_set(name: str, value: Any, default: Any) -> bool:
    if value is default:
        return False
    if name == "compress":  # False, [] and None all mean "encode nothing"
        return callable(value) or bool(value)
    if callable(value) or isinstance(value, (list, tuple)):
        return True
    return bool(value != default)


#: the keyword names that build a SaveOptions
OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(SaveOptions))


def options_from(options: SaveOptions | None, *, where: str, path: str | None = None, **given: Any) -> SaveOptions:
    """One record from ``options`` and the option keywords of a call (``compress=...``):
    a keyword left at its default takes ``options``' value; a keyword that disagrees with
    a non-default value in ``options`` is refused (``SaveOptionError``)."""
    base = options if options is not None else SaveOptions()
    fields = {f.name: f.default for f in dataclasses.fields(SaveOptions)}
    changes: dict[str, Any] = {}
    for name, value in given.items():
        if not _is_set(name, value, fields[name]):
            continue
        held = getattr(base, name)
        if _is_set(name, held, fields[name]) and held is not value and held != value:
            raise SaveOptionError(f"{where}: {name}={value!r} and options.{name}={held!r} disagree; give it once",
                                  path=path, options=[name])
        changes[name] = value
    return dataclasses.replace(base, **changes) if changes else base
