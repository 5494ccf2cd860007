"""``ckpt.open(p).state("model")``, ``.config()``, ``.context()`` with tensors in ``extra``,
and ``load`` of a checkpoint whose ``extra`` holds tensors (issue 13 §2 and the reader API)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.errors import ChecksumMismatchError, FormatError
from ckpt.knobs import override


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    m = _model()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 32)).sum().backward()
    opt.step()
    path = tmp_path / "step-00000007"
    with override(chunk_size=4096):  # small chunks: an optimizer tensor shares none with the model's
        ckpt.save(path, {"model": m, "optim": opt, "model_args": {"dim": 32, "hidden": 64}},
                  config={"model": {"dim": 32, "hidden": 64}, "lr": 1e-3, "id2label": {0: "a", 1: "b"}},
                  extra={"ema": torch.arange(4.0), "note": "kept"}, step=7)
    return path, m, opt


def test_state_of_one_entry_is_a_plain_state_dict(saved) -> None:
    path, m, _ = saved
    sd = ckpt.open(path).state("model")
    assert list(sd) == list(m.state_dict())  # no "model/" prefix, the module's own order
    fresh = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    assert not fresh.load_state_dict(sd, strict=True).missing_keys
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), m.state_dict().values()))
    assert ckpt.open(path).state("model_args") == {"dim": 32, "hidden": 64}
    whole = ckpt.open(path).state()
    assert set(whole) == {"model", "optim", "model_args"}
    # the optimizer's many small tensors (several to a 4 KiB chunk, some spanning two): read once each, equal
    opt = ckpt.open(path).state("optim")
    assert opt["param_groups"] == whole["optim"]["param_groups"]
    for i, st in whole["optim"]["state"].items():
        assert all(torch.equal(v, opt["state"][i][k]) for k, v in st.items())


def test_state_of_one_entry_reads_only_its_tensors(saved) -> None:
    """Bytes of an optimizer tensor are corrupted: the model entry still reads (its chunks
    are intact and it never touches the optimizer's); the whole state fails, naming them."""
    path, m, _ = saved
    r = ckpt.open(path)
    pe = r.parts[0]
    f = pe.file("tensors")
    model_chunks = {c for t in pe.tensors if t.key.startswith("model/")
                    for c in range(t.offset // f.chunk_size, (t.offset + t.nbytes - 1) // f.chunk_size + 1)}
    victim = next(t for t in reversed(pe.tensors) if t.key.startswith("optim/") and t.nbytes >= f.chunk_size
                  and (t.offset + t.nbytes - 1) // f.chunk_size not in model_chunks)
    raw = bytearray((path / f.name).read_bytes())
    raw[victim.offset + victim.nbytes - 1] ^= 0xFF
    (path / f.name).write_bytes(bytes(raw))
    sd = ckpt.open(path).state("model")
    assert torch.equal(sd["0.weight"], m[0].weight)
    with pytest.raises(ChecksumMismatchError):
        ckpt.open(path).state()


def test_config_reads_only_the_structure_file(saved, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _, _ = saved
    tensors = next(path.glob("*.safetensors"))
    tensors.write_bytes(bytes(tensors.stat().st_size))  # same size, all zeros: any read of it would fail
    real_open = os.open

    def guarded(p, *a, **k):
        assert not os.fspath(p).endswith(".safetensors"), f"config() opened {p}"
        return real_open(p, *a, **k)

    monkeypatch.setattr(os, "open", guarded)
    r = ckpt.open(path)
    assert r.config() == {"id2label": {0: "a", 1: "b"}, "lr": 1e-3, "model": {"dim": 32, "hidden": 64}}
    assert r.state("model_args") == {"dim": 32, "hidden": 64}  # a tensor-free entry: structure file only
    assert r.entries() == ("model", "optim", "model_args")
    monkeypatch.setattr(os, "open", real_open)
    with pytest.raises(FormatError, match="safetensors header"):  # the tensors were never needed until now
        r.state("model")


def test_config_is_none_without_one(tmp_path: Path) -> None:
    ckpt.save(tmp_path / "c", {"w": torch.ones(2)})
    assert ckpt.open(tmp_path / "c").config() is None


def test_context_resolves_tensors_in_extra(saved) -> None:
    path, _, _ = saved
    extra = ckpt.open(path).context()["extra"]
    assert isinstance(extra["ema"], torch.Tensor) and torch.equal(extra["ema"], torch.arange(4.0))
    assert extra["note"] == "kept"


def test_load_returns_extra_with_its_tensors(saved) -> None:
    path, m, opt = saved
    info = ckpt.load(path, {"model": m, "optim": opt})
    assert torch.equal(info.extra["ema"], torch.arange(4.0)) and info.extra["note"] == "kept"


def test_unknown_entry_is_named(saved) -> None:
    path, _, _ = saved
    with pytest.raises(FormatError, match=r"no entry 'modle'.*\['model', 'model_args', 'optim'\]"):
        ckpt.open(path).state("modle")


def test_a_part_name_as_first_argument_still_works_with_a_warning(saved) -> None:
    path, m, _ = saved
    r = ckpt.open(path)
    with pytest.warns(DeprecationWarning, match="state\\(part='rank-00000'\\)"):
        st = r.state("rank-00000")
    assert set(st) == {"model", "optim", "model_args"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(r.state(part="rank-00000")) == set(st)
