"""Chandy-Lamport snapshots of a running job, written as one multi-part checkpoint.

See spec/snapshot-protocol.md. ``SnapshotAgent`` takes part in (and coordinates)
snapshots on an ``Endpoint``; a ``SnapshotStore`` writes the parts (``CkptSnapshotStore``
for real runs); a ``ControlPlane`` carries part records to the coordinator.
"""

from __future__ import annotations

from replay.snapshot.agent import (
    CHANNELS_KEY,
    Outcome,
    RestoreInfo,
    SnapshotAgent,
    SnapshotHandle,
    StagingPool,
)
from replay.snapshot.check import Cut, check_cut, cut_from_meta, delivery_order
from replay.snapshot.store import (
    CkptSnapshotStore,
    ControlPlane,
    MemoryControl,
    MemorySnapshotStore,
    Pending,
    SnapshotStore,
    TorchStoreControl,
)

__all__ = [
    "CHANNELS_KEY",
    "CkptSnapshotStore",
    "ControlPlane",
    "Cut",
    "MemoryControl",
    "MemorySnapshotStore",
    "Outcome",
    "Pending",
    "RestoreInfo",
    "SnapshotAgent",
    "SnapshotHandle",
    "SnapshotStore",
    "StagingPool",
    "TorchStoreControl",
    "check_cut",
    "cut_from_meta",
    "delivery_order",
]
