"""Per-step replica fault tolerance on torchft, taped and replayable, with SDC checks.

See ``run.py`` (record / replay), ``worker.py`` (one rank's loop), ``coord.py`` (torchft or
the tape as the coordinator), ``procs.py`` (the orchestrator) and ``demo.py``.
"""

from __future__ import annotations

from runs.replicas.config import Join, Kill, ReplicaConfig, SdcFault, Spike
from runs.replicas.run import ENTRY_POINT, RunResult, main, record

__all__ = ["ReplicaConfig", "Kill", "Join", "SdcFault", "Spike", "RunResult", "record", "main", "ENTRY_POINT"]
