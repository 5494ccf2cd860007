"""Where a replica rank's step time goes: consecutive laps of one clock per step attempt.

The step loop is sequential, so each lap is the time since the previous one, charged to
the part that just ran; the parts of an attempt add up to the attempt's whole time (no
gap is left unattributed). A lap costs one ``perf_counter`` call and a dict update
(well under a microsecond), cheap enough to run in every recorded run; bench/replicas.py
reads the laps from the ranks' results (``RankResult.parts``).
"""

from __future__ import annotations

import time

__all__ = ["PARTS", "StepClock"]

# quorum: starting torchft's quorum and waiting for it (with async quorum only what the
# compute did not hide); compute: forward and backward; gather: the gradient into the
# flat buffer (and the intra-group sum); allreduce: the fault-tolerant all-reduce through
# the manager (and the group's agreement on its outcome); sdc: digests and verdicts;
# exchange: the step's agreement all-reduce (digests, votes, veto); commit: torchft's
# should_commit; optim: the gradient back into the parameters and the optimizer step;
# tape: the tape's events and the step's log flush; rest: everything else.
PARTS = ("quorum", "compute", "gather", "allreduce", "sdc", "exchange", "commit", "optim", "tape", "rest")


class StepClock:
    """Laps per step attempt: ``start()`` at the attempt's start, ``lap(part)`` after each
    part, ``end()`` closes the attempt (its laps appended to ``parts``)."""

    def __init__(self) -> None:
        self.parts: dict[str, list[float]] = {p: [] for p in PARTS}
        self._cur: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self._last = time.perf_counter()

    def start(self) -> None:
        self._cur = dict.fromkeys(PARTS, 0.0)
        self._last = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self._cur[part] += now - self._last  # KeyError on a part not in PARTS: a typo, not a new part
        self._last = now

    def end(self) -> None:
        self.lap("rest")
        for p, v in self._cur.items():
            self.parts[p].append(v)
