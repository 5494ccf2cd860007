"""Driving in-process snapshot agents in the replay tests (no threads: the test polls)."""

from __future__ import annotations

import time
from typing import Any, Iterable

from replay.errors import PeerDiedError

__all__ = ["pump"]


def pump(agents: Iterable[Any], handle: Any, timeout: float | None = None) -> Any:
    """Poll every agent until the snapshot ``handle`` is done (a dead peer's error is the
    snapshot's business, not the poller's); its outcome. ``timeout``: a hang bound
    (default ``hangs.hang_s(1)``), never a speed verdict."""
    from hangs import hang_s

    agents = list(agents)
    end = time.monotonic() + (hang_s(1) if timeout is None else timeout)
    while not handle.done() and time.monotonic() < end:
        for ag in agents:
            try:
                ag.poll()
            except PeerDiedError:
                pass
        time.sleep(0.001)
    return handle.wait(1)
