"""The order a sharded sampler draws, saved and drawn again on resume (Lightning, Accelerate).

Under more than one process Lightning replaces a loader's sampler by a distributed one.
It recognises only torch's own ``RandomSampler`` and ``SequentialSampler`` (those become a
plain ``DistributedSampler``); any other sampler, ``torchdata``'s ``RandomSampler`` (what
``StatefulDataLoader(shuffle=True)`` builds) included, is wrapped in a
``DistributedSamplerWrapper``. On every ``iter()`` that wrapper draws a whole new order
from the inner sampler (``_DatasetSamplerWrapper.reset``: ``list(sampler)``; torchdata's
sampler advances its own generator by one permutation) and shards it. The
``StatefulDataLoader`` state holds only the position in that shard (the wrapper is not
``Stateful``), and a loader builds the iterator of a restored state with more ``iter()``
calls than the saved run made for that epoch (measured: 4 against 2 per epoch). So the
resumed epoch read another permutation than the saved run from its first batch, and
only a resume into the epoch whose permutation happened to be drawn as often (the
second) was exact.

:class:`OrderDraws`, installed as each wrapper's ``reset``, captures the RNG streams the
draw depends on (the inner sampler's own ``generator`` when it has one, and Python,
numpy and torch CPU, which a sampler without a generator draws from) before each draw.
The callback saves the capture of the draw that made the current order, per rank; on
resume, every draw made while the restored iterator is built starts from those streams,
so it reproduces the saved order and leaves the sampler's generator where the saved run
had it (the next epoch's draws continue it). A sampler whose order depends on anything
else (state of its own, another library's RNG) is not covered.

Accelerate shards a prepared loader's batch sampler (``BatchSamplerShard``) instead, with the
same effect: the ``StatefulDataLoader`` state no longer holds torchdata's ``RandomSampler``
generator, each iterator draws one permutation from it, and a resumed process has drawn
fewer (measured: only a resume into the second epoch read the saved order).
:class:`IteratorDraws`, installed as the loader's ``_get_iterator``, keeps the generator's
state before each iterator is built; the integration saves it with the loader's state, and
the first iterator built after the load starts from it. Only the sampler's generator is
set: the global streams are the caller's (Accelerate users restore them themselves).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from ..context.rng import capture_rng, restore_rng

__all__ = ["OrderDraws", "install", "saved_orders", "pin", "unpin", "IteratorDraws", "record_iterators"]


def _wrapper(loader: Any) -> Any:
    """The ``_DatasetSamplerWrapper`` behind a loader's ``DistributedSamplerWrapper``
    (as ``sampler`` or ``batch_sampler.sampler``, where Lightning puts it), or None."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    for s in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(s, DistributedSamplerWrapper):
            return s.dataset
    return None


def _generators(inner: Any) -> dict[str, torch.Generator]:
    g = getattr(inner, "generator", None)
    return {"sampler": g} if isinstance(g, torch.Generator) else {}


class OrderDraws:
    """A ``_DatasetSamplerWrapper``'s ``reset``: draws the order as Lightning's does, from
    streams captured before the draw (``before``), or, while ``pinned``, from the pinned
    capture (the saved run's)."""

    def __init__(self, wrapper: Any) -> None:
        self._wrapper = wrapper
        self._draw = wrapper.reset  # Lightning's own, bound to the instance
        self.before: dict[str, Any] | None = None
        self.pinned: Mapping[str, Any] | None = None

    def __call__(self) -> None:
        generators = _generators(self._wrapper._sampler)
        if self.pinned is not None:
            # the global streams are the saved run's for the draw only: the callback
            # restores the step's streams right after the restored iterator is built
            restore_rng(self.pinned, generators)
        self.before = capture_rng(generators)
        self._draw()


def _draws(loader: Any) -> OrderDraws | None:
    wrapper = _wrapper(loader)
    draws = None if wrapper is None else wrapper.__dict__.get("reset")
    return draws if isinstance(draws, OrderDraws) else None


def install(loaders: Iterable[Any]) -> None:
    """Put an :class:`OrderDraws` on the sampler wrapper of each loader that has one
    (before its first ``iter()``; again on a loader Lightning rebuilt)."""
    for loader in loaders:
        wrapper = _wrapper(loader)
        if wrapper is not None and _draws(loader) is None:
            wrapper.reset = OrderDraws(wrapper)


def saved_orders(loaders: Iterable[Any]) -> list[dict[str, Any] | None]:
    """Per loader: the streams the current order was drawn from (None: no wrapper, or
    no order drawn yet)."""
    out: list[dict[str, Any] | None] = []
    for loader in loaders:
        draws = _draws(loader)
        out.append(None if draws is None else draws.before)
    return out


def pin(loaders: Iterable[Any], orders: Any) -> None:
    """Make every draw of these loaders' orders, until :func:`unpin`, start from the
    saved streams (``orders``: :func:`saved_orders` of the saved run, per loader)."""
    if not isinstance(orders, list):
        return  # saved without them (one process, or an older version)
    for loader, saved in zip(loaders, orders):
        draws = _draws(loader)
        if draws is not None and isinstance(saved, Mapping):
            draws.pinned = saved


def unpin(loaders: Iterable[Any]) -> None:
    for loader in loaders:
        draws = _draws(loader)
        if draws is not None:
            draws.pinned = None


def _order_generator(loader: Any) -> torch.Generator | None:
    """The ``generator`` of the first sampler under a loader that has one (through
    ``sampler`` and ``batch_sampler``, however deep the wrappers nest them)."""
    todo, seen = [loader], set()
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator):
            return g
        todo += [getattr(obj, "batch_sampler", None), getattr(obj, "sampler", None)]
    return None


class IteratorDraws:
    """A ``StatefulDataLoader``'s ``_get_iterator``: keeps the order generator's state
    before each iterator is built (``before``); with ``pinned`` set, the next iterator
    starts from that state instead (once: later epochs continue from it)."""

    def __init__(self, loader: Any, generator: torch.Generator) -> None:
        self._build = loader._get_iterator  # torchdata's own, bound to the instance
        self._generator = generator
        self.before: torch.Tensor | None = None
        self.pinned: torch.Tensor | None = None

    def __call__(self) -> Any:
        if self.pinned is not None:
            self._generator.set_state(self.pinned)
            self.pinned = None
        self.before = self._generator.get_state()
        return self._build()


def record_iterators(loader: Any) -> IteratorDraws | None:
    """Install (once) and return the :class:`IteratorDraws` of the ``StatefulDataLoader``
    under ``loader`` (prepared or not); None when there is none or its sampler has no
    generator."""
    base = getattr(loader, "base_dataloader", loader)
    draws = getattr(base, "__dict__", {}).get("_get_iterator")
    if isinstance(draws, IteratorDraws):
        return draws
    if not (callable(getattr(base, "_get_iterator", None)) and callable(getattr(base, "state_dict", None))):
        return None
    generator = _order_generator(base)
    if generator is None:
        return None
    draws = IteratorDraws(base, generator)
    base._get_iterator = draws
    return draws
