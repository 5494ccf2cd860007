"""Anticipatory routing (spec/loss-guard.md §7): after a rollback, the MoE routing of the
next K batches is computed with the restored weights and replayed when they are trained.

An MoE layer chooses its experts through :func:`select`::

    idx = ckpt.guard.routing.select(self, logits, k)    # [tokens, k] expert ids
    gates = torch.softmax(logits.gather(-1, idx), -1)    # current weights at those ids

Without a guard that routes, ``select`` is ``logits.topk(k).indices``. With one, it
returns the cached ids for a batch warmed up after a rollback: expert *choice* from the
restored weights, gates, computation and update from the current ones.

Which controller ``select`` asks: the one passed as ``router=`` (the guard's
``guard.routing``), else the one a ``LossGuard`` installed in the current context (a
:class:`contextvars.ContextVar`, not a module global: each thread, and each context
copied with ``contextvars.copy_context()``, has its own). A guard installs its
controller in the context that constructs it, so the layers' call needs no handle as
long as the forward pass runs in the thread that built the guard; a forward run
elsewhere passes ``router=`` explicitly.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ..errors import GuardError
from . import events as ev

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["select", "current", "RoutingController", "encode_experts", "decode_experts", "MAX_EXPERTS"]

#: expert ids are taped as u16
MAX_EXPERTS = 1 << 16

#: the controller the layers' ``select`` asks when none is passed (see the module docstring)
_active: ContextVar["RoutingController | None"] = ContextVar("ckpt.guard.routing", default=None)


def current() -> "RoutingController | None":
    """The controller installed in the current context, if any."""
    return _active.get()


def select(layer: Any, logits: "torch.Tensor", k: int, *, router: "RoutingController | None" = None) -> "torch.Tensor":
    """The ``k`` experts each token goes to, as ``[tokens, k]`` int64 ids, for the MoE
    layer ``layer`` whose router produced ``logits`` (``[tokens, experts]``). ``router``:
    the controller to ask (default: the one installed in the current context)."""
    ctl = router if router is not None else _active.get()
    if ctl is not None:
        got = ctl.select(layer, logits, k)
        if got is not None:
            return got
    return logits.topk(k, dim=-1).indices


def encode_experts(idx: "torch.Tensor") -> bytes:
    """``[tokens, k]`` ids as u16 LE bytes in row order (the ``routing`` event's form)."""
    import torch

    flat = idx.detach().to("cpu").reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= MAX_EXPERTS):
        raise GuardError(f"expert ids must lie in [0, {MAX_EXPERTS}) to be taped")
    return flat.to(torch.int32).numpy().astype("<u2").tobytes()


def decode_experts(raw: bytes, k: int, *, device: Any = None) -> "torch.Tensor":
    import numpy as np
    import torch

    if k < 1 or len(raw) % (2 * k):
        raise GuardError(f"routing of {len(raw)} bytes is not tokens x {k} u16 ids")
    ids = torch.from_numpy(np.frombuffer(raw, dtype="<u2").astype(np.int64)).reshape(-1, k)
    return ids if device is None else ids.to(device)


class RoutingController:
    """The routing a guard caches after a rollback and replays while those batches train.

    ``names``: module -> layer name (the model's ``named_modules``); ``current``: the key
    ``(epoch, step)`` of the batch being trained (the loader's last batch); ``tape``:
    ``(record, decide)`` callables the guard provides (decide runs the capture through a
    forced replay's taped decision)."""

    def __init__(self, model: Any, current: Callable[[], tuple[int, int] | None],
                 record: Callable[[ev.GuardRecord], None], decide: Callable[[int, Callable[[], bytes]], bytes]) -> None:
        self._names = {id(m): n for n, m in model.named_modules()}
        self._current = current
        self._record = record
        self._decide = decide
        self.cache: dict[tuple[int, int, str], "torch.Tensor"] = {}
        self._capturing: tuple[int, int] | None = None
        #: (epoch, step, layer, digest) of every replay, in order (what tests compare)
        self.replayed: list[tuple[int, int, str, bytes]] = []

    # -- installation: one controller per context ---------------------------------------------
    def install(self) -> None:
        """Make this the controller ``select`` asks in the current context (thread)."""
        other = _active.get()
        if other is not None and other is not self:
            raise GuardError("another LossGuard with routing is installed in this thread (context): close it first")
        _active.set(self)

    def uninstall(self) -> None:
        """Stop answering ``select`` in the current context (a no-op where another is installed)."""
        if _active.get() is self:
            _active.set(None)

    # -- the MoE layers' call -----------------------------------------------------------------
    def _name(self, layer: Any) -> str:
        name = self._names.get(id(layer))
        if name is None:
            raise GuardError(f"select() called by a {type(layer).__name__} that is not a module of the guarded model")
        return name

    def select(self, layer: Any, logits: "torch.Tensor", k: int) -> "torch.Tensor | None":
        if self._capturing is not None:
            return self._capture(self._name(layer), logits, k)
        if not self.cache:
            return None
        key = self._current()
        if key is None:
            return None
        name = self._name(layer)
        ids = self.cache.get((key[0], key[1], name))
        if ids is None:
            return None
        if ids.shape != (logits.shape[0], k):
            raise GuardError(f"cached routing of layer {name!r} for epoch {key[0]} step {key[1]} is "
                             f"{tuple(ids.shape)}, the batch routes {logits.shape[0]} tokens to {k} experts")
        digest = ev.experts_digest(encode_experts(ids))
        self._record(ev.RoutingReplay(name, key[0], key[1], digest))
        self.replayed.append((key[0], key[1], name, digest))
        return ids.to(logits.device)

    def _capture(self, name: str, logits: "torch.Tensor", k: int) -> "torch.Tensor":
        epoch, step = self._capturing  # type: ignore[misc]

        def compute() -> bytes:
            raw = encode_experts(logits.topk(k, dim=-1).indices)
            return ev.encode_payload(ev.Routing(name, epoch, step, k, raw, ev.experts_digest(raw)))[1]

        rec = ev.decode_payload(ev.ROUTING, self._decide(ev.ROUTING, compute))
        assert isinstance(rec, ev.Routing)
        if (rec.layer, rec.epoch, rec.batch, rec.k) != (name, epoch, step, k):
            raise GuardError(f"the taped routing is for layer {rec.layer!r} epoch {rec.epoch} step {rec.batch} "
                             f"k {rec.k}; this forward asks for {name!r} epoch {epoch} step {step} k {k}")
        ids = decode_experts(rec.experts, k)
        self.cache[(epoch, step, name)] = ids
        return ids.to(logits.device)

    # -- the guard's calls --------------------------------------------------------------------
    def warm(self, batches: Iterable[tuple[tuple[int, int], Any]], forward: Callable[[Any], Any]) -> None:
        """Run ``forward`` on each ``((epoch, step), batch)``, capturing every layer's routing
        (the caller holds no_grad and the RNG isolation)."""
        for key, batch in batches:
            self._capturing = key
            try:
                forward(batch)
            finally:
                self._capturing = None

    def trained(self, keys: Iterable[tuple[int, int]]) -> None:
        """These batches were trained: their entries go."""
        done = set(keys)
        for key in [key for key in self.cache if (key[0], key[1]) in done]:
            del self.cache[key]

    def clear(self) -> None:
        self.cache.clear()

    def state(self) -> list[list[Any]]:
        return [[e, s, name, int(ids.shape[1]), encode_experts(ids)] for (e, s, name), ids in self.cache.items()]

    def load(self, entries: Iterable[Any]) -> None:
        self.cache = {}
        for entry in entries:
            e, s, name, k, raw = entry
            self.cache[(int(e), int(s), str(name))] = decode_experts(bytes(raw), int(k))
