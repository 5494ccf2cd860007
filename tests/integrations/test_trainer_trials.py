"""Random-kill trials of every trainer integration (issue 25), as their users write a run:
``trainer_trial.py`` (a tiny GPT-style model, ``num_workers=2`` with random augmentation in
the workers, warmup + decay, accumulation 2, clipping, dropout, bf16 autocast on CPU, a
save every 4 steps, 6 steps per epoch). Each trial SIGKILLs a run at a seeded random point
(after a save, at a step end, mid-accumulation), resumes it in a fresh process and compares
every later loss, parameter, optimizer and scheduler tensor and the final RNG with
``torch.equal`` against a straight run. ``bench/trainer_trials.py`` runs many more."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchdata.stateful_dataloader")

sys.path.insert(0, str(Path(__file__).parent))
import trainer_trial as T  # noqa: E402

from ckpt.ledger import read_ledger_dir  # noqa: E402

STEPS = 14


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {}


def _straight(cache: dict[str, Path], tmp: pytest.TempPathFactory, trainer: str, loader: str) -> Path:
    key = f"{trainer}-{loader}"
    if key not in cache:
        d = tmp.mktemp(key)
        T.launch(T.command(trainer, loader, str(d / "run"), str(d / "out"), STEPS), expect_kill=False)
        cache[key] = d / "out"
    return cache[key]


def _trial(cache: dict[str, Path], tmp: pytest.TempPathFactory, tmp_path: Path, trainer: str, loader: str,
           kill: int, where: str) -> None:
    ref = _straight(cache, tmp, trainer, loader)
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    T.launch(T.command(trainer, loader, run, out, STEPS, kill, where), expect_kill=True)
    err = T.launch(T.command(trainer, loader, run, out, STEPS), expect_kill=False)
    assert T.differences(str(ref), out) == [], f"{trainer}/{loader} killed {where}@{kill}"
    # the run directory's step ledger verified the resume: exact wherever steps were re-executed
    checks = [c for t in read_ledger_dir(str(tmp_path / "run" / "ledger"))[0] for c in t.checks]
    assert "diverged" not in err and all(c.verdict != "diverged" for c in checks), checks
    if where != "save":  # the killed run recorded steps after the checkpoint it resumed from
        assert [c.verdict for c in checks] == ["exact"], checks


MODES = [("hf", "resumable"), ("lightning", "stateful"), ("lightning", "resumable"),
         ("accelerate", "stateful"), ("accelerate", "resumable")]
# one seeded random kill point per mode, plus the epoch end (step 12 is the last of epoch 2)
# for the StatefulDataLoader modes, which were not exact before (issue 25)
CASES = [(t, lo, *T.draw(random.Random(f"{t}/{lo}"), STEPS)) for t, lo in MODES]
CASES += [("lightning", "stateful", 12, "save"), ("accelerate", "stateful", 12, "save"), ("hf", "resumable", 9, "micro"),
          ("lightning", "stateful-main", 12, "save"), ("lightning", "stateful-main-plain", 12, "save"),
          ("accelerate", "stateful-main", 9, "micro"),
          pytest.param("accelerate", "stateful-main-plain", 9, "micro", marks=pytest.mark.xfail(strict=True, reason=(
              "not exact: augmentation drawing from the main process's global RNG (num_workers=0, no WorkerRNG) "
              "with a prepared StatefulDataLoader, resumed mid-epoch. Accelerate's DataLoaderShard fetches one "
              "batch ahead, so the saved run drew the next batch's augmentation before the step's dropout, in one "
              "stream, and the checkpoint holds the position before that batch: the resumed run draws it again, "
              "after the restore (measured). WorkerRNG gives the augmentation its own streams: exact")))]


def _case(case: object) -> Any:
    """The case with its id, in the pytest-xdist group of its straight run: the trials of one
    trainer and loader share that run (the ``straight`` cache is per worker process)."""
    values, marks = (case.values, list(case.marks)) if hasattr(case, "values") else (case, [])
    t, lo, kill, where = values  # type: ignore[misc]
    group = pytest.mark.xdist_group(f"straight-{t}-{lo}")
    return pytest.param(*values, id=f"{t}-{lo}-{where}{kill}", marks=[*marks, group])


@pytest.mark.slow
@pytest.mark.parametrize(("trainer", "loader", "kill", "where"), [_case(c) for c in CASES])
def test_random_kill_resumes_bit_identically(straight: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
                                             tmp_path: Path, trainer: str, loader: str, kill: int, where: str) -> None:
    _trial(straight, tmp_path_factory, tmp_path, trainer, loader, kill, where)


@pytest.mark.slow
def test_worker_rng_makes_stateful_dataloader_workers_continue_their_streams(tmp_path: Path) -> None:
    """Regression (issue 25): a restored ``StatefulDataLoader`` reseeds its workers from the
    base seed, so random augmentation in them differs after a mid-epoch resume. Wrapped in
    ``WorkerRNG``, the restored loader yields exactly the batches the saved one would have."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    import ckpt
    from ckpt.integrations.stateful_data import WorkerRNG

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(WorkerRNG(T.Augmented()), batch_size=4, shuffle=True, num_workers=2)

    torch.manual_seed(0)
    a = loader()
    it = iter(a)
    for _ in range(5):
        next(it)
    ckpt.save(str(tmp_path / "c"), {"loader": a})  # as the integrations save it: a pickle-free tree
    rest = [b["input_ids"] for b in it]
    b = loader()
    ckpt.load(str(tmp_path / "c"), {"loader": b})
    torch.manual_seed(123)  # another main-process RNG: the workers' streams come from the state
    again = [x["input_ids"] for x in b]
    assert len(again) == len(rest) == 7 and all(torch.equal(x, y) for x, y in zip(rest, again))


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["lightning", "accelerate"])
def test_ledger_names_an_inexact_resume(tmp_path: Path, trainer: str) -> None:
    """Lightning and Accelerate run directories keep the step ledger (issue 25): a resume
    that is not exact (a ``StatefulDataLoader`` whose workers augment at random, without
    ``WorkerRNG``: the workers restart their streams) is reported, naming the first step
    that differs and what differs."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    T.launch(T.command(trainer, "stateful-plain", run, out, 12, 10, "step"), expect_kill=True)
    err = T.launch(T.command(trainer, "stateful-plain", run, out, 12), expect_kill=False)
    assert "ResumeVerificationWarning" in err and "resume diverged at step 9" in err
    tapes, problems = read_ledger_dir(str(tmp_path / "run" / "ledger"))
    assert problems == [] and [s.step for s in tapes[0].steps][-2:] == [9, 10]
    (check,) = [c for t in tapes for c in t.checks]
    assert check.verdict == "diverged" and check.first == 9 and "batch differs" in check.report


def test_worker_rng_in_the_main_process_keeps_augmentation_out_of_the_global_stream(tmp_path: Path) -> None:
    """With ``num_workers=0`` the wrapped dataset draws from streams of its own: the global
    RNG is untouched by a fetch, and a loader restored from a state taken mid-epoch (with
    any global RNG) yields exactly the batches the saved one would have."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    import ckpt
    from ckpt.integrations.stateful_data import WorkerRNG

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(WorkerRNG(T.Augmented(), seed=11), batch_size=4, shuffle=True, num_workers=0)

    torch.manual_seed(0)
    a = loader()
    it = iter(a)  # the shuffle draws its seed from the global RNG here, as without the wrapper
    before = torch.random.get_rng_state()
    for _ in range(5):
        next(it)
    assert torch.equal(torch.random.get_rng_state(), before)  # the augmentation drew elsewhere
    ckpt.save(str(tmp_path / "c"), {"loader": a})
    rest = [b["input_ids"] for b in it]
    b = loader()
    ckpt.load(str(tmp_path / "c"), {"loader": b})
    torch.manual_seed(123)
    again = [x["input_ids"] for x in b]
    assert len(again) == len(rest) == 7 and all(torch.equal(x, y) for x, y in zip(rest, again))
    # and the streams are the seed's: the same order (the same global seed) with another
    # wrapper seed augments differently, and with the same seed identically
    def first(seed: int) -> torch.Tensor:
        torch.manual_seed(0)
        dl = StatefulDataLoader(WorkerRNG(T.Augmented(), seed=seed), batch_size=4, shuffle=True, num_workers=0)
        return next(iter(dl))["input_ids"]

    assert torch.equal(first(11), first(11)) and not torch.equal(first(11), first(12))
