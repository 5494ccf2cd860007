"""Random-kill trials of the trainer integrations (the trainer table of docs/trainers/index.md).

Per trainer and loader: one straight run, then ``--trials`` runs each SIGKILLed at a
seeded random point (after a save, at a step end, or mid-accumulation), resumed in a
fresh process and compared bit for bit with the straight run (every later micro-batch
loss, every parameter, optimizer and scheduler tensor, the final RNG). The run is
``tests/integrations/trainer_trial.py``: a tiny GPT-style model, ``num_workers=2`` with
random augmentation in the workers, warmup + decay, accumulation 2, clipping, dropout,
bf16 autocast on CPU. Prints, per mode, trials run and identical, and each difference.

``--multiproc``: the same on 2 gloo processes (``tests/integrations/trainer_multiproc.py``:
Lightning ``strategy="ddp"`` and FSDP2 (``lightning-fsdp2``) with its own launcher, Accelerate
under ``torchrun``); the kill takes down the whole job, and every rank's final state is
compared.

    python bench/trainer_trials.py --trials 10 [--modes hf/resumable,lightning/stateful] [--seed 0]
    python bench/trainer_trials.py --multiproc --trials 5 [--modes lightning/stateful,accelerate/resumable]
"""

from __future__ import annotations

import os
import sys

# the trial run lives with the tests (tests/integrations/trainer_trial.py)
sys.path[0] = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "integrations")

import argparse  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import trainer_trial as T  # noqa: E402

MODES = ("hf/resumable", "lightning/resumable", "lightning/stateful", "accelerate/resumable", "accelerate/stateful")
MULTIPROC_MODES = ("lightning/stateful", "lightning/resumable", "lightning-fsdp2/stateful", "lightning-fsdp2/resumable",
                   "accelerate/stateful", "accelerate/resumable")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=10, help="trials per mode")
    p.add_argument("--modes", default=None, help="trainer/loader,... (default: every mode)")
    p.add_argument("--multiproc", action="store_true", help="2 gloo processes per run (trainer_multiproc.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=14)
    a = p.parse_args()
    if a.multiproc:
        import trainer_multiproc as M

        command, launch, differences = M.command, M.launch, M.differences
    else:
        command, launch, differences = T.command, T.launch, T.differences
    modes = a.modes or ",".join(MULTIPROC_MODES if a.multiproc else MODES)
    rng = random.Random(a.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes.split(","):
            trainer, loader = mode.split("/")
            base = os.path.join(tmp, mode.replace("/", "-"))
            straight = os.path.join(base, "straight-out")
            launch(command(trainer, loader, os.path.join(base, "straight-run"), straight, a.steps), expect_kill=False)
            same = 0
            t0 = time.perf_counter()
            # 2 processes, stateful loader: the suite's fixed epoch points (resume in the third
            # epoch; a save after an epoch's last batch) on every trainer, then the random ones
            fixed = [(k, w) for k, w, _ in M.EPOCH_POINTS if k < a.steps] if a.multiproc and loader == "stateful" else []
            for i in range(len(fixed) + a.trials):
                kill, where = fixed[i] if i < len(fixed) else T.draw(rng, a.steps)
                run, out = os.path.join(base, f"t{i}-run"), os.path.join(base, f"t{i}-out")
                try:
                    launch(command(trainer, loader, run, out, a.steps, kill, where), expect_kill=True)
                    launch(command(trainer, loader, run, out, a.steps), expect_kill=False)
                    diff = differences(straight, out)
                except RuntimeError as e:  # a run that failed is a trial that is not identical
                    diff = ["FAILED " + str(e).splitlines()[0] + " | " + " ".join(str(e).splitlines()[-1:])]
                same += not diff
                print(f"  {mode} kill {where}@{kill}: {'identical' if not diff else 'DIFFERENT: ' + '; '.join(diff[:4])}",
                      flush=True)
            rows.append((mode, len(fixed) + a.trials, same, time.perf_counter() - t0))
    print(f"\n{'trainer/loader':24} {'trials':>6} {'identical':>9}")
    for mode, n, same, _ in rows:
        print(f"{mode:24} {n:>6} {same:>9}")
    sys.exit(0 if all(n == s for _, n, s, _ in rows) else 1)


if __name__ == "__main__":
    main()
