"""A three-rank gloo run whose rank 2 is stopped or killed mid-collective (tests/runs/common/test_watchdog.py).

    python stuck_run.py WATCH_DIR stop|kill STALL_S

Ranks all-reduce in a loop, beating before each collective. Once every rank has beaten
past step 5, this orchestrator SIGSTOPs (a rank that stops answering: its peers wait in
the collective for ever) or SIGKILLs rank 2, then waits for the workers on their exits
under the progress watchdog. Exit 0 never happens: 3 when the watchdog named a hang
(``HangError``), 1 when a worker failed.
"""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from replay.errors import HangError  # noqa: E402
from replay.watchdog import beat  # noqa: E402
from runs.common.procs import Workers, join_gloo, serve_store  # noqa: E402

WORLD = 3


def rank_main(rank: int, port: int) -> None:  # a child process
    import torch
    import torch.distributed as dist

    beat("joining gloo")  # past the imports: start-up is progress too
    join_gloo(rank, WORLD, port, timeout_s=3600)  # gloo's own timeout never ends this run's hang
    t = torch.ones(4)
    step = 0
    while True:
        beat(f"all_reduce step {step}")
        dist.all_reduce(t)
        step += 1


def main() -> int:
    watch, fault, stall_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    served = serve_store(timeout_s=3600)  # rank 0's too: this process serves the store, the ranks join it
    port = served.port
    with Workers(watch=watch, stall_s=stall_s, name="orchestrator") as w:
        for r in range(WORLD):
            w.start(f"rank{r}", rank_main, r, port)
        dog = w.watchdog
        assert dog is not None
        # every rank past step 5: it is in its collectives (waits on their heartbeats)
        while not all(dog.last_beat(f"rank{r}")[1].startswith("all_reduce step ")
                      and int(dog.last_beat(f"rank{r}")[1].rsplit(" ", 1)[1]) >= 5 for r in range(WORLD)):
            if w.failed():
                print(f"a rank failed before the fault: {w.exitcodes()}", flush=True)
                return 1
            dog.fired.wait(0.05)
            w.check()
        os.kill(w["rank2"].pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        print(f"rank2 {'stopped' if fault == 'stop' else 'killed'} at {dog.last_beat('rank2')[1]}", flush=True)
        try:
            codes = w.join()
        except HangError as e:
            print(f"hang: {e}", flush=True)
            return 3
        print(f"exit codes: {codes}", flush=True)
        return 1 if any(c != 0 for c in codes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
