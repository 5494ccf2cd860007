"""HF Trainer: a run SIGKILLed mid-run and resumed in a fresh process ends bit-identical.

Single process and DDP over 2 gloo processes. The trainer script is
``hf_gpt2_run.py`` (a tiny GPT-2 from a config, generated tokens, dropout on, AdamW,
cosine schedule with warmup, gradient accumulation 2, epochs of an odd micro-batch count).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import hangs
import worlds

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ckpt  # noqa: E402

# multi-process runs, subprocesses or heavy imports: `make check` leaves them out
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("hf_gpt2_run.py")
STEPS = 12


def _run(run_dir: Path, out: Path, *, world: int, kill_at: int = 0, settled: bool = False) -> list[int]:
    """Start ``world`` fresh processes (as torchrun would) and return their exit codes."""
    store = worlds.agent_store() if world > 1 else None  # held until every rank has exited
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        if store is not None:
            env.update(worlds.launch_env(store, rank, world))
        cmd = [sys.executable, str(SCRIPT), "--run-dir", str(run_dir), "--out", str(out), "--steps", str(STEPS)]
        if kill_at:
            cmd += ["--kill-at", str(kill_at), *(["--kill-settled"] if settled else [])]
        procs.append(hangs.popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    codes, outputs = [], []
    for p in procs:
        o, _ = hangs.communicate(p, bound_s=hangs.hang_s(24))
        codes.append(p.returncode)
        outputs.append(o.decode(errors="replace"))
    if kill_at == 0 and any(codes):
        raise AssertionError("trainer run failed:\n" + "\n----\n".join(o[-3000:] for o in outputs))
    return codes


def _assert_identical(a: Path, b: Path, kill_at: int) -> None:
    ra, rb = ckpt.open(a), ckpt.open(b)
    keys = list(ra.iter_tensor_keys())
    assert keys == list(rb.iter_tensor_keys()) and len(keys) > 50
    differ = [k for k in keys if not torch.equal(ra.tensor(k), rb.tensor(k))]
    assert differ == [], f"tensors differ after resume: {differ[:5]}"
    ca, cb = ra.context(), rb.context()
    assert ca["rng"] == cb["rng"]  # python, numpy, torch CPU: bit-equal states
    assert ca["extra"]["log"] == cb["extra"]["log"] and len(ca["extra"]["log"]) == STEPS  # every step's loss, lr, grad norm, epoch
    assert ca["extra"]["epoch"] == cb["extra"]["epoch"]
    assert ca["extra"]["resumed_from"] is None
    last = kill_at // 3 * 3  # saves every 3 steps: the newest before the kill, unless its async save was still in flight
    assert cb["extra"]["resumed_from"] in (last - 3, last)
    assert ca["extra"]["untouched"] and cb["extra"]["untouched"]  # transformers.trainer.skip_first_batches never replaced
    assert ca["extra"]["positioned_steps"] == 0


@pytest.fixture(scope="module")
def straight() -> dict[int, Path]:
    """The straight runs' outputs, by world size: one per worker process, so the cases of one
    world size are in one pytest-xdist group (``hf-world-N``)."""
    return {}


def _straight(cache: dict[int, Path], tmp: pytest.TempPathFactory, world: int) -> Path:
    if world not in cache:
        d = tmp.mktemp(f"hf-straight-{world}")
        _run(d / "run", d / "out", world=world)
        cache[world] = d / "out"
    return cache[world]


@pytest.mark.slow
@pytest.mark.parametrize("world,kill_at", [pytest.param(w, k, marks=pytest.mark.xdist_group(f"hf-world-{w}"))
                                           for w, k in ((1, 8), (2, 8), (1, 10))])
def test_hf_trainer_kill_and_resume_in_fresh_processes_is_bit_identical(straight: dict[int, Path],
                                                                         tmp_path_factory: pytest.TempPathFactory,
                                                                         tmp_path: Path, world: int,
                                                                         kill_at: int) -> None:
    """Kill at 8: the resume starts an epoch (step 6: 11 micro-batches, one epoch, on one rank).
    Kill at 10 on one rank, once the save of 9 committed: step 9 is 6 micro-batches into
    epoch 1, the mid-epoch resume that Trainer would skip batches for. The straight run of a
    world size is shared by its cases (it is the same run)."""
    if world > 1 and not torch.distributed.is_gloo_available():
        pytest.skip("gloo is not available")
    out_a = _straight(straight, tmp_path_factory, world)
    codes = _run(tmp_path / "crashed", tmp_path / "out-b", world=world, kill_at=kill_at, settled=kill_at == 10)
    assert codes == [-9] * world  # SIGKILL: no cleanup ran
    assert not (tmp_path / "out-b").exists()
    _run(tmp_path / "crashed", tmp_path / "out-b", world=world)
    for rank in range(world):
        _assert_identical(out_a / f"rank-{rank}", tmp_path / "out-b" / f"rank-{rank}", kill_at)
    if kill_at == 10:  # the resumed epoch's 3 optimizer steps (10-12) came from the positioned loader
        extra = ckpt.open(tmp_path / "out-b" / "rank-0").context()["extra"]
        assert (extra["resumed_from"], extra["positioned_steps"]) == (9, 3)
    # the run directory holds ckpt checkpoints only: Trainer wrote no pickle files
    names = {p.name for p in (tmp_path / "crashed").iterdir()}
    assert {"step-00000009", "step-00000012"} <= names
    assert not list((tmp_path / "crashed").rglob("*.pth")) and not list((tmp_path / "crashed").rglob("*.bin"))
    man = ckpt.open(tmp_path / "crashed" / "step-00000012")
    assert [p.name for p in man.parts] == [f"rank-{r:05d}" for r in range(world)]
    trainer_state = man.context(f"rank-{world - 1:05d}")
    assert trainer_state["config"]["hash"].startswith("sha256:")  # GPT2Config.to_dict(), int keys and all
