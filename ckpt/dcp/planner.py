"""Pickle-free DCP planners.

DCP's default planners turn every non-tensor value into bytes with ``torch.save`` and
back with ``torch.load`` (weights_only off): pickle. These keep DCP's planning (which
rank writes which chunk, de-duplication, resharding) and move values as state trees
instead: a save refuses a value our msgpack tree cannot encode with
``UnsupportedValueError`` naming its fqn, during local planning, before any file is
written; a load sets values straight into the state dict.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, WriteItem, WriteItemType

from ..errors import CkptError, UnsupportedValueError
from ..format.tree import to_wire

__all__ = ["SavePlanner", "LoadPlanner", "check_value", "set_value"]


def check_value(value: Any, fqn: str) -> None:
    """Refuse a value §7.3 cannot encode, or one holding a tensor (values hold none, §S.1)."""
    from ..writer import _Collector  # the writer's own hook: same dtype/device rules

    collector = _Collector("")
    to_wire(value, collector, (fqn,))
    if collector.tensors:
        raise UnsupportedValueError("a non-tensor state value holds a tensor; put tensors at their own key", key=fqn)


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, refusing what would need pickle (a tensor inside a non-tensor value)."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                check_value(self.lookup_object(item.index), item.index.fqn)
        return plan

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            # ckpt.dcp.StorageWriter takes values with lookup_object; nothing may pickle.
            raise CkptError(f"value {write_item.index.fqn!r}: ckpt.dcp never serialises values with torch.save")
        return object


def set_value(planner: Any, item: ReadItem, value: Any) -> None:
    """Put a loaded value where DCP's default load planner would have put the unpickled one."""
    fqn = item.dest_index.fqn
    if isinstance(planner, DefaultLoadPlanner):
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[fqn], value)
        else:
            planner.state_dict[fqn] = value
        return
    setter = getattr(planner, "load_value", None)
    if setter is None:
        raise CkptError(f"value {fqn!r}: planner {type(planner).__name__} only takes pickled bytes; use ckpt.dcp.LoadPlanner")
    setter(item, value)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, setting plain values without pickle."""

    def load_value(self, read_item: ReadItem, value: Any) -> None:
        set_value(self, read_item, value)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CkptError(f"value {read_item.dest_index.fqn!r}: ckpt.dcp never unpickles")

