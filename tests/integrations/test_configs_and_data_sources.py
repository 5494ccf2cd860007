"""Configs from HF/Lightning/OmegaConf-style libraries, and what ``data=`` accepts."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

import ckpt
from ckpt import CheckpointManager
from ckpt.context.config import canonical_config, config_hash
from ckpt.errors import UnsupportedValueError
import hangs


class FrozenMap(Mapping):
    """A mapping that is not a dict, as OmegaConf's DictConfig is not."""

    def __init__(self, d: dict[Any, Any]) -> None:
        self._d = d

    def __getitem__(self, k: Any) -> Any:
        return self._d[k]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


def test_int_keys_are_stored_losslessly_in_a_fixed_order() -> None:
    a = {"id2label": {1: "B", 0: "A"}, "label2id": {"B": 1, "A": 0}}
    b = {"label2id": {"A": 0, "B": 1}, "id2label": {0: "A", 1: "B"}}
    assert config_hash(a) == config_hash(b)
    decoded = msgpack.unpackb(canonical_config(a), raw=False, strict_map_key=False)
    assert decoded["id2label"] == {0: "A", 1: "B"} and list(decoded["id2label"]) == [0, 1]
    # int and str keys are different keys, both kept; ints sort first, numerically
    mixed = {"10": 1, 2: 2, -5: 3, "a": 4, 10: 5}
    assert list(msgpack.unpackb(canonical_config(mixed), strict_map_key=False)) == [-5, 2, 10, "10", "a"]
    assert config_hash({0: "a"}) != config_hash({"0": "a"})


@pytest.mark.parametrize(
    "bad, what",
    [({True: 1}, "bool"), ({1.5: 1}, "float"), ({None: 1}, "NoneType"), ({(1, 2): 1}, "tuple"), ({1 << 70: 1}, "64 bits")],
)
def test_keys_without_a_canonical_form_are_refused_by_name(bad: dict[Any, Any], what: str) -> None:
    with pytest.raises(UnsupportedValueError, match=what) as ei:
        config_hash({"outer": bad})
    assert ei.value.key.startswith("config/outer/")


def test_enum_keys_that_collide_with_their_value_are_refused() -> None:
    class K(enum.Enum):
        A = "a"

    with pytest.raises(UnsupportedValueError, match="collide"):
        config_hash({K.A: 1, "a": 2})


def test_hf_pretrained_config_to_dict_is_accepted(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=97, num_labels=3)
    d = cfg.to_dict()
    assert any(isinstance(k, int) for k in d["id2label"])  # the case that used to be refused
    model = torch.nn.Linear(2, 2)
    ckpt.save(tmp_path / "c", {"model": model}, config=d, step=1)
    assert ckpt.open(tmp_path / "c").part().summary["config_hash"] == config_hash(d)
    # the same config rebuilt from its dict hashes the same
    assert config_hash(transformers.GPT2Config.from_dict(d).to_dict()) == config_hash(d)


def test_lightning_hparams_dataclass_and_mapping_configs() -> None:
    @dataclasses.dataclass
    class Optim:
        lr: float = 3e-4
        betas: tuple[float, float] = (0.9, 0.95)

    @dataclasses.dataclass
    class Run:
        optim: Optim = dataclasses.field(default_factory=Optim)
        layers: list[int] = dataclasses.field(default_factory=lambda: [64, 64])
        id2label: dict[int, str] = dataclasses.field(default_factory=lambda: {0: "neg", 1: "pos"})

    plain = {"optim": {"lr": 3e-4, "betas": [0.9, 0.95]}, "layers": [64, 64], "id2label": {1: "pos", 0: "neg"}}
    omegaconf_like = FrozenMap({"layers": (64, 64), "id2label": FrozenMap({0: "neg", 1: "pos"}),
                                "optim": FrozenMap({"betas": (0.9, 0.95), "lr": 3e-4})})
    hashes = {config_hash(Run()), config_hash(plain), config_hash(omegaconf_like)}
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.fabric.utilities.data import AttributeDict

    class M(pl.LightningModule):
        def __init__(self, optim: dict[str, Any], layers: list[int], id2label: dict[int, str]) -> None:
            super().__init__()
            self.save_hyperparameters()

    hp = M(**plain).hparams
    assert isinstance(hp, AttributeDict)
    hashes.add(config_hash(hp))
    assert len(hashes) == 1


def test_data_without_state_dict_fails_at_construction(tmp_path: Path) -> None:
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=True)
    with pytest.raises(UnsupportedValueError, match=r"torch\.utils\.data\.dataloader\.DataLoader has no state_dict\(\)") as ei:
        CheckpointManager(tmp_path / "run", {"model": torch.nn.Linear(2, 2)}, data=loader)
    assert "ResumableLoader" in str(ei.value) and "StatefulDataLoader" in str(ei.value)
    assert not (tmp_path / "run").exists()  # refused before touching the disk


def _sdl_run(run_dir: Path, total: int, *, with_generator: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The README's StatefulDataLoader pattern: defer RNG, create the iterator, restore."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(40, 4, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(3) if with_generator else None
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True, generator=gen)
    mgr = CheckpointManager(run_dir, {"model": model, "optim": opt}, data=loader, every_steps=3,
                            generators={"loader": gen} if gen is not None else None)
    resumed = mgr.resume(defer_rng=True)
    it = iter(loader)          # draws its base seed (global RNG or the loader's generator) ...
    if resumed is not None:
        mgr.restore_rng()      # ... then the streams are put back where the saved run had them
    step, losses = mgr.start_step, []
    while step < total:
        for batch in it:
            loss = model(batch).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            losses.append(loss.item())
            mgr.after_step(step)
            if step == total:
                break
        it = iter(loader)
    mgr.close()
    return losses, {**model.state_dict(), **{f"opt/{k}": v for k, v in opt.state_dict()["state"][0].items()}}


@pytest.mark.parametrize("with_generator", [False, True])
def test_torchdata_stateful_dataloader_resumes_mid_epoch_exactly(tmp_path: Path, with_generator: bool) -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    # 10 batches per epoch: the cut at step 12 is mid-epoch, the run crosses two epoch ends
    straight, ws = _sdl_run(tmp_path / "a", 25, with_generator=with_generator)
    _sdl_run(tmp_path / "b", 13, with_generator=with_generator)
    tail, wr = _sdl_run(tmp_path / "b", 25, with_generator=with_generator)
    assert tail == straight[12:]
    assert ws.keys() == wr.keys() and all(torch.equal(ws[k], wr[k]) for k in ws)


@pytest.mark.slow
def test_import_ckpt_never_imports_the_integrations_or_their_libraries() -> None:
    import sys

    code = (
        "import sys, ckpt, ckpt.integrations; from ckpt import CheckpointManager; import ckpt.data; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('transformers', 'lightning', 'pytorch_lightning', 'accelerate', 'torchdata') "
        "or m.startswith('ckpt.integrations.')))"
    )
    out = hangs.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2],
                    bound_s=hangs.hang_s(6))
    assert out.stdout.strip() == "[]"


def test_the_spec_worked_example_of_a_config_with_int_keys() -> None:
    import re

    spec = (Path(__file__).resolve().parents[2] / "spec" / "checkpoint-format.md").read_text(encoding="utf-8")
    m = re.search(r"config\s+`(\{.*?\})` has `canonical` \(hex\)\s+`([0-9a-f]+)` and `hash`\s+`(sha256:[0-9a-f]+)`", spec, re.S)
    assert m is not None
    cfg = {"n_layer": 2, "id2label": {1: "B", 0: "A"}}
    assert m.group(1) == '{"n_layer": 2, "id2label": {1: "B", 0: "A"}}'
    assert canonical_config(cfg).hex() == m.group(2) and config_hash(cfg) == m.group(3)
