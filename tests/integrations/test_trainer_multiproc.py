"""Random-kill trials on 2 gloo processes (issue 25, item 4), as users launch each trainer:
Lightning ``Trainer(accelerator="cpu", devices=2, strategy="ddp")`` (its own launcher), the same
with FSDP2 (``CkptModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)``), and
``CkptAccelerator(cpu=True)`` under ``torchrun --standalone --nproc-per-node 2``; the run
of ``trainer_trial.py`` (``num_workers=2`` with random augmentation, warmup + decay,
accumulation 2, clipping, dropout, bf16 autocast). Each trial SIGKILLs the whole job (both
ranks and their DataLoader workers, as a node loss does) at a seeded random point,
resumes it in fresh processes and compares, on every rank, every later loss, parameter,
optimizer and scheduler tensor and the final RNG with ``torch.equal`` against a straight
2-process run. ``bench/trainer_trials.py --multiproc`` runs more. A resume at another
world size is refused (``ResumeMismatchError``), never called exact."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchdata.stateful_dataloader")

sys.path.insert(0, str(Path(__file__).parent))
import trainer_multiproc as M  # noqa: E402
import trainer_trial as T  # noqa: E402

from ckpt.ledger import read_ledger_dir  # noqa: E402

STEPS = 10
MODES = [("lightning", "stateful"), ("lightning", "resumable"), ("lightning-fsdp2", "stateful"),
         ("lightning-fsdp2", "resumable"), ("accelerate", "stateful"), ("accelerate", "resumable")]
CASES = [(t, lo, *T.draw(random.Random(f"multiproc/{t}/{lo}"), STEPS)) for t, lo in MODES]
# StatefulDataLoader (shuffled) under 2 processes: Lightning shards torchdata's RandomSampler
# through a DistributedSamplerWrapper, which draws a new permutation from the sampler's own
# generator at every iter(); Accelerate shards the batch sampler (BatchSamplerShard), and each
# iterator draws one permutation. Either way the loader state no longer holds that generator
# and a resumed process has drawn another number of permutations, so only a resume into the
# second epoch (the random draws above) read the saved order until ckpt replayed the draw
# (ckpt/integrations/_sampler_order.py). 48 samples, 2 ranks, batch 4, accumulation 2: 3
# steps an epoch. Killed at step 9: resumed from step 8, in the third epoch. Saved at step
# 12, after the fourth epoch's last batch (under Lightning the next epoch's iterator is built
# before it sets the samplers' epoch). The sampler-order replay and the epoch bookkeeping are
# the callback's, whatever the strategy: FSDP2 runs the same code as ddp there, so its two
# epoch cases (five 2-process launches) run in ``bench/trainer_trials.py --multiproc``, which
# tries both fixed points on every stateful mode beside its random ones.
EPOCH_STEPS = 14
EPOCHS = [pytest.param(t, "stateful", k, w, s, id=f"{t}-stateful-{w}{k}-{label}",
                       marks=pytest.mark.xdist_group(f"multiproc-{t}-stateful-{s}"))
          for t in ("lightning", "accelerate") for k, w, label in M.EPOCH_POINTS
          for s in [STEPS if w == "step" else EPOCH_STEPS]]


@pytest.fixture(scope="module")
def straight() -> dict[str, Path]:
    """The straight 2-process runs, by trainer and loader: one per worker process, so the tests
    that read one are in its pytest-xdist group (``multiproc-TRAINER-LOADER-STEPS``)."""
    return {}


def _straight(cache: dict[str, Path], tmp: pytest.TempPathFactory, trainer: str, loader: str, steps: int) -> Path:
    key = f"{trainer}-{loader}-{steps}"
    if key not in cache:
        d = tmp.mktemp(key)
        M.launch(M.command(trainer, loader, str(d / "run"), str(d / "out"), steps), expect_kill=False)
        cache[key] = d / "out"
    return cache[key]


def _newest_manifest(run: str, name: str | None = None) -> tuple[str, bytes]:
    """The newest committed checkpoint of a run directory (or ``name``) and its MANIFEST."""
    if name is None:
        name = max(n for n in os.listdir(run) if n.startswith("step-") and os.path.isfile(Path(run, n, "MANIFEST")))
    return name, Path(run, name, "MANIFEST").read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a hang bound for up to three 2-process jobs (tests/hangs.py), never a speed verdict
@pytest.mark.parametrize(("trainer", "loader", "kill", "where", "steps"),
                         [pytest.param(*c, STEPS, id=f"{c[0]}-{c[1]}-{c[3]}{c[2]}",
                                       marks=pytest.mark.xdist_group(f"multiproc-{c[0]}-{c[1]}-{STEPS}"))
                          for c in CASES] + EPOCHS)
def test_two_process_random_kill_resumes_bit_identically(straight: dict[str, Path],
                                                         tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
                                                         trainer: str, loader: str, kill: int, where: str,
                                                         steps: int) -> None:
    ref = _straight(straight, tmp_path_factory, trainer, loader, steps)
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    M.launch(M.command(trainer, loader, run, out, steps, kill, where), expect_kill=True)
    resumed_from = _newest_manifest(run)
    err = M.launch(M.command(trainer, loader, run, out, steps), expect_kill=False)
    assert M.differences(str(ref), out) == [], f"{trainer}/{loader} killed {where}@{kill}"
    # the checkpoint resumed from is never saved again (Lightning's ModelCheckpoint did,
    # mid-accumulation, at the first resumed micro-batch: a second kill resumed inexactly)
    assert _newest_manifest(run, resumed_from[0]) == resumed_from
    # each rank keeps its own ledger tape directory, and none saw its resume diverge
    verdicts = []
    for r in range(M.PROCS):
        tapes, problems = read_ledger_dir(os.path.join(run, "ledger", f"rank-{r:05d}"))
        checks = [c for t in tapes for c in t.checks]
        assert problems == [] and checks and all(c.verdict != "diverged" for c in checks), (r, checks)
        verdicts += [c.verdict for c in checks]
    if where != "save" and kill % T.SAVE_EVERY:
        # The rank that killed the job recorded the steps after its last save; the other
        # may not have (the kill takes it down anywhere): at least one verified exact.
        assert "exact" in verdicts, verdicts
    assert "diverged" not in err


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a hang bound for up to three 2-process jobs (tests/hangs.py), never a speed verdict
@pytest.mark.parametrize("trainer", [pytest.param(t, marks=pytest.mark.xdist_group(f"multiproc-{t}-resumable-{STEPS}"))
                                     for t in ("lightning", "lightning-fsdp2", "accelerate")])
def test_a_world_size_change_is_refused_not_called_exact(straight: dict[str, Path],
                                                         tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
                                                         trainer: str) -> None:
    """A 2-process run resumed by 1 process stops with ``ResumeMismatchError`` naming both
    world sizes before a step is taken; the run's checkpoints are untouched. The run is the
    straight 2-process run of the trials (its checkpoints are what a resume loads)."""
    ref = _straight(straight, tmp_path_factory, trainer, "resumable", STEPS)
    run, out = str(ref.parent / "run"), str(tmp_path / "out")
    before = sorted(os.listdir(run))
    with pytest.raises(RuntimeError) as e:
        M.launch(M.command(trainer, "resumable", run, out, STEPS, procs=1), expect_kill=False)
    assert "ResumeMismatchError" in str(e.value) and "saved by 2 process(es), this run has 1" in str(e.value)
    assert sorted(os.listdir(run)) == before and not os.path.exists(out)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a hang bound for one 2-process job (tests/hangs.py), never a speed verdict
def test_fsdp2_ranks_training_independent_replicas_are_refused_at_the_first_save(tmp_path: Path) -> None:
    """``CkptModelParallelStrategy()`` with Lightning's default sizes on one node: a data-parallel
    mesh of 1 and 2-way tensor parallelism that this module does not use, each rank reading its
    own batches. Both ranks then train their own copy of the whole model, and the full state
    dict would hold rank 0's only (rank 1 would resume from rank 0's weights: the 0/2 of the
    first FSDP2 trials). The first save refuses it, naming the parameter and the fix."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    with pytest.raises(RuntimeError) as e:
        M.launch(M.command("lightning-fsdp2-auto", "resumable", run, out, STEPS), expect_kill=False)
    message = str(e.value)
    assert "StateMismatchError" in message and "independent replicas" in message, message[-3000:]
    assert "data_parallel_size=2, tensor_parallel_size=1" in message
    assert not any(n.startswith("step-") for n in os.listdir(run)) and not os.path.exists(out)
