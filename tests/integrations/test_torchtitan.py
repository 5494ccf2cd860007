"""torchtitan's checkpoint component on the ckpt format: exact resume on 2 gloo ranks.

torchtitan 0.3.0's ``Trainer`` does not train on a CPU-only torch; where it stops, in order
(each pinned below, so that a torchtitan that gets past one is noticed):

1. ``import torchtitan.trainer`` imports ``triton`` (torchtitan/distributed/minimal_async_ep/
   kernels.py line 10), which is not a dependency of torchtitan and not installed with a CPU
   torch: ``ModuleNotFoundError: No module named 'triton'``;
2. with triton installed: the device is ``"cuda"`` whenever no accelerator is found
   (torchtitan/tools/utils.py line 55, ``_get_available_device_type() or "cuda"``), so
   ``Trainer.__init__`` fails at ``device_module.set_device(self.device)`` (trainer.py line
   301): ``AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'``;
3. with the device forced to ``cpu`` (and ``torch.cpu`` given the memory-stat functions
   torchtitan's metrics call): the llama3 debug model builds and runs forward, and its
   first backward stops in FlexAttention, the only attention the language models accept
   besides varlen (models/common/config_utils.py): ``NotImplementedError: FlexAttention does
   not support backward on CPU`` (torch/nn/attention/flex_attention.py line 2082); varlen
   (``llama3_debugmodel_varlen_attn``) stops at ``aten::_flash_attention_forward``, which has
   no CPU kernel (torchtitan/models/common/attention.py line 201).

So the trials run torchtitan's training step by hand on its own components
(``torchtitan_run.py``: ``OptimizersContainer`` AdamW, ``LRSchedulersContainer`` warmup and
decay, a ``dp_rank``-keyed stateful loader, the ``train_state`` entry, FSDP2 over gloo,
dropout, clipping) with the checkpoint manager called as torchtitan's trainer calls it, under
torchrun on 2 processes: straight, SIGKILLed after step 5 (the last save at step 4, or 2 when
an async save was still in flight), resumed in fresh processes, compared bit for bit.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan not installed (make venv installs it)")

from hangs import hang_s, run  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("torchtitan_run.py")
WORLD, STEPS, KILL_AT = 2, 8, 5


def _train(dump: Path, *args: str, kill_at: int = 0) -> subprocess.CompletedProcess:
    from ckpt.testing.kill_switch import kill_env

    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_LEDGER")}
    if kill_at:  # the harnesses' kill switch, in every rank (rank 0's ledger fires it)
        env.update(kill_env(kill_at, env))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           str(SCRIPT), "--dump", str(dump), "--steps", str(STEPS), "--interval", "2", *args]
    p = run(cmd, bound_s=hang_s(60), cwd=ROOT, env=env)
    if kill_at:
        assert p.returncode != 0, "the run was to be killed after step %d" % kill_at
    elif p.returncode:
        raise AssertionError(p.stdout[-2000:] + p.stderr[-4000:])
    return p


def _final(dump: Path) -> list[dict[str, Any]]:
    return [json.loads((dump / f"final-rank{r}.json").read_text()) for r in range(WORLD)]


def _kill_and_resume(dump: Path, *args: str) -> tuple[list[dict[str, Any]], subprocess.CompletedProcess]:
    _train(dump, *args, kill_at=KILL_AT)
    assert not (dump / "final-rank0.json").exists()
    resumed = _train(dump, *args)
    return _final(dump), resumed


def _differences(straight: list[dict[str, Any]], resumed: list[dict[str, Any]]) -> list[str]:
    out = []
    for r, (a, b) in enumerate(zip(straight, resumed)):
        assert b["losses"], "the resumed run trained no step"
        out += [f"rank {r} loss at step {s}" for s in b["losses"] if a["losses"][s] != b["losses"][s]]
        out += [f"rank {r} {k}" for k in ("params", "optim", "lr", "train_state", "loader_pos", "rng") if a[k] != b[k]]
    return out


@pytest.fixture(scope="module")
def straight_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("titan-straight")
    _train(d)
    return d


@pytest.fixture(scope="module")
def straight(straight_dir: Path) -> list[dict[str, Any]]:
    return _final(straight_dir)


def test_resume_after_sigkill_is_bit_identical_and_every_save_is_a_ckpt_checkpoint(
        straight: list[dict[str, Any]], tmp_path: Path) -> None:
    final, resumed = _kill_and_resume(tmp_path)
    assert _differences(straight, final) == []
    assert sorted(final[0]["losses"], key=int) == ["5", "6", "7", "8"]  # resumed from step-4
    assert final[0]["resume_verdict"] == "exact"
    assert "ResumeVerified: resume verified exact over steps 5..5" in resumed.stderr
    folder = tmp_path / "checkpoint"
    steps = sorted(n for n in os.listdir(folder) if n.startswith("step-"))
    assert steps == ["step-2", "step-4", "step-6", "step-8"]
    for n in steps:  # our MANIFEST, one part per rank; nothing of torchtitan's pickled format
        files = set(os.listdir(folder / n))
        assert "MANIFEST" in files and ".metadata" not in files and not any(f.endswith(".distcp") for f in files)
    v = run([sys.executable, "-m", "ckpt_cli.main", "verify", str(folder / "step-8")], bound_s=hang_s(10), cwd=ROOT)
    assert v.returncode == 0 and v.stdout.startswith("ok: "), v.stdout + v.stderr
    assert (folder / "ledger").is_dir()


def test_async_saves_resume_bit_identically(straight: list[dict[str, Any]], tmp_path: Path) -> None:
    final, resumed = _kill_and_resume(tmp_path, "--async-mode", "async")
    assert _differences(straight, final) == []
    assert final[0]["resume_verdict"] == "exact", resumed.stderr[-3000:]


def test_torchtitans_own_checkpoint_resumes_inexactly_with_dropout(straight: list[dict[str, Any]], tmp_path: Path) -> None:
    """The baseline: torchtitan's own checkpoint holds no RNG state, so a model that draws
    random numbers (dropout here) continues differently after a resume."""
    final, _ = _kill_and_resume(tmp_path, "--native")
    assert (tmp_path / "checkpoint" / "step-4" / ".metadata").is_file()
    diffs = _differences(straight, final)
    assert "rank 0 loss at step 5" in diffs and "rank 0 rng" in diffs


def test_a_world_size_change_is_reported_never_called_exact(straight_dir: Path) -> None:
    """The 2-rank FSDP2 save loads into one plain process (DCP reshards), with ckpt.load's
    environment gate: the world-size change is named."""
    import importlib.util as iu

    from ckpt.errors import EnvironmentMismatchError
    from ckpt.integrations.torchtitan import CkptCheckpointManager
    from ckpt._load import ExactnessWarning
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    spec = iu.spec_from_file_location("torchtitan_run", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def manager(exactness: str) -> Any:
        model = mod.Tiny()
        optimizers = default_adamw(lr=3e-3).build(model_parts=[model])
        scheds = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
        config = CkptCheckpointManager.Config(enable=True, load_only=True, keep_latest_k=0, ledger=False,
                                              exactness=exactness)  # type: ignore[arg-type]
        state = mod.TrainState()
        m = config.build(dataloader=mod.Loader(0), model_parts=[model], optimizers=optimizers, lr_schedulers=scheds,
                         states={"train_state": state}, sd_adapter=None, base_folder=str(straight_dir))
        return m, state

    m, state = manager("warn")
    with pytest.warns(ExactnessWarning, match=r"world_size: 2 -> 1"):
        assert m.load()
    assert state.step == STEPS
    m, state = manager("strict")
    with pytest.raises(EnvironmentMismatchError, match="world_size"):
        m.load()
    assert state.step == 0  # refused before anything was touched


def test_pinned_memory_async_is_refused_by_name() -> None:
    from ckpt.errors import SaveOptionError
    from ckpt.integrations.torchtitan import CkptCheckpointManager

    config = CkptCheckpointManager.Config(enable=True, async_mode="async_with_pinned_mem")
    with pytest.raises(SaveOptionError, match="async_with_pinned_mem"):
        config.build(dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None)


def test_committed_steps_skip_saves_in_flight_and_foreign_folders(tmp_path: Path) -> None:
    import ckpt
    from ckpt.integrations.torchtitan import committed_steps

    ckpt.save(tmp_path / "step-3", {"w": torch.ones(2)}, step=3)
    (tmp_path / ".tmp-step-5-0123456789ab").mkdir()  # a save in flight
    (tmp_path / "step-7").mkdir()  # torn: no MANIFEST
    (tmp_path / "ledger").mkdir()
    assert committed_steps(str(tmp_path)) == {3: str(tmp_path / "step-3")}


def test_torchtitan_trainer_still_stops_where_the_docstring_says() -> None:
    """When one of these fails, torchtitan moved: try its real Trainer on CPU again."""
    if not torch.cuda.is_available():
        from torchtitan.tools import utils

        assert utils.device_type == "cuda"  # stop 2: no CPU device type
    if importlib.util.find_spec("triton") is None:
        # stop 1 (``torchtitan.trainer`` reaches this module; with make's component-only
        # install it stops earlier, at the first dependency left out)
        with pytest.raises(ModuleNotFoundError, match="triton"):
            import torchtitan.distributed.minimal_async_ep.kernels  # noqa: F401
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 1, 8, 4, requires_grad=True)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, q, q)  # stop 3
