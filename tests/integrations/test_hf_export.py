"""``ckpt export hf`` against transformers' own classes: a tiny GPT-2 built from a config
(nothing downloaded), saved with ckpt next to its optimizer, exported, and loaded back
with ``from_pretrained``: equal logits, tied weights tied, shards with an index."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import ckpt  # noqa: E402
from ckpt.interop.hf import export_hf  # noqa: E402
import hangs

# multi-process runs, subprocesses or heavy imports: `make check` leaves them out
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT2LMHeadModel, torch.Tensor]:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()  # trained a step: the weights are not the init, and the optimizer has state
    model.eval()
    path = tmp_path_factory.mktemp("hf") / "step-00000001"
    # the config as CkptTrainer saves it: {"model": config.to_dict()}
    ckpt.save(path, {"model": model, "optim": opt}, config={"model": model.config.to_dict(), "lr": 1e-2}, step=1)
    return path, model, x


def _logits(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return m(input_ids=x).logits


def test_from_pretrained_gives_equal_logits(saved, tmp_path: Path) -> None:
    path, model, x = saved
    res = export_hf(path, tmp_path / "out")
    assert res.files == ("model.safetensors", "config.json") and res.config == "config.json"
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    assert torch.equal(_logits(loaded, x), _logits(model, x))
    # tied as HF ties them: one tensor, not two equal copies
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    # what save_pretrained itself writes: the same names (no lm_head.weight, no model/ prefix, no optimizer)
    model.save_pretrained(tmp_path / "ref")
    with safe_open(str(tmp_path / "ref" / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())
        for n in names:
            assert torch.equal(f.get_tensor(n), model.state_dict()[n])
    assert res.tied == (("transformer.wte.weight", "lm_head.weight"),)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["n_embd"] == 32


def test_sharded_above_the_threshold_with_an_index(saved, tmp_path: Path) -> None:
    path, model, x = saved
    res = export_hf(path, tmp_path / "out", max_shard_size="40KB")
    shards = [f for f in res.files if f.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == res.total_size == sum(
        t.numel() * t.element_size() for n, t in model.state_dict().items() if n != "lm_head.weight")
    assert set(index["weight_map"].values()) == set(shards) and "lm_head.weight" not in index["weight_map"]
    for shard in shards:  # every shard within the limit, except a tensor that alone exceeds it
        with safe_open(str(tmp_path / "out" / shard), "pt") as f:
            sizes = [f.get_tensor(k).numel() * 4 for k in f.keys()]
        assert sum(sizes) <= 40_000 or len(sizes) == 1
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    assert torch.equal(_logits(loaded, x), _logits(model, x))


def test_untied_config_writes_both_copies(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=31, n_positions=8, tie_word_embeddings=False)
    model = GPT2LMHeadModel(cfg).eval()
    ckpt.save(tmp_path / "c", {"model": model}, config=model.config.to_dict())
    res = export_hf(tmp_path / "c", tmp_path / "out")
    assert res.tied == ()
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(0, 31, (1, 8))
    assert torch.equal(_logits(loaded, x), _logits(model, x))
    assert loaded.lm_head.weight.data_ptr() != loaded.transformer.wte.weight.data_ptr()


def test_cli_export_hf_as_a_user_runs_it(saved, tmp_path: Path) -> None:
    path, model, x = saved
    out = tmp_path / "exported"
    env = dict(os.environ, CKPT_PROGRESS="0")
    p = hangs.run([sys.executable, "-m", "ckpt_cli", "export", "hf", str(path), str(out)], capture_output=True,
                  text=True, bound_s=hangs.hang_s(30), env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0].startswith(f"exported 'model' of {path} -> {out}: model.safetensors (28 tensors,")
    assert "tied: lm_head.weight is transformer.wte.weight" in p.stdout
    loaded = GPT2LMHeadModel.from_pretrained(out).eval()
    assert torch.equal(_logits(loaded, x), _logits(model, x))
    p = hangs.run([sys.executable, "-m", "ckpt_cli", "export", "hf", str(path), str(out)], capture_output=True,
                  text=True, bound_s=hangs.hang_s(30), env=env)
    assert p.returncode == 2 and "is not empty" in p.stderr  # never mixed into an earlier export
    p = hangs.run([sys.executable, "-m", "ckpt_cli", "inspect", str(out)], capture_output=True, text=True,
                  bound_s=hangs.hang_s(30), env=env)
    assert p.returncode == 7 and "a Hugging Face model directory" in p.stderr
