"""One SaveOptions record for every save path; an option a path does not support is
refused by name (SaveOptionError) before anything is written, never dropped silently."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import SaveOptions
from ckpt.errors import CkptError, SaveOptionError


def _written(root: Path) -> list[str]:
    return sorted(os.listdir(root)) if root.exists() else []


def test_options_record_and_keywords_write_the_same_checkpoint(tmp_path: Path) -> None:
    state = {"w": torch.randn(256, 128), "b": torch.arange(10)}
    a = ckpt.save(tmp_path / "kw", state, compress=True, dedup=True)
    b = ckpt.save(tmp_path / "rec", state, options=SaveOptions(compress=True, dedup=True))
    roles = lambda info: sorted(f.role for f in info.manifest.parts[0].files)  # noqa: E731
    assert roles(a) == roles(b) and "packed" in " ".join(roles(a)), roles(a)
    assert torch.equal(ckpt.open(tmp_path / "rec").tensor("w"), state["w"])
    # one record reused for a second save: passed through unchanged
    opts = SaveOptions(overwrite=True, dedup_from=str(tmp_path / "rec"))
    c = ckpt.save(tmp_path / "rec", state, options=opts)
    assert c.manifest.version >= (2, 0) and opts == SaveOptions(overwrite=True, dedup_from=str(tmp_path / "rec"))


def test_a_one_process_save_refuses_part_options_by_name(tmp_path: Path) -> None:
    with pytest.raises(SaveOptionError) as ei:
        ckpt.save(tmp_path / "x", {"w": torch.ones(2)}, options=SaveOptions(part_manifests=True))
    assert "part_manifests" in str(ei.value) and "ckpt.save" in str(ei.value)
    assert ei.value.context["options"] == ["part_manifests"] and "compress" in ei.value.context["supports"]
    assert isinstance(ei.value, CkptError) and isinstance(ei.value, TypeError)
    assert _written(tmp_path) == []  # refused before anything was written


def test_a_keyword_that_disagrees_with_the_record_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SaveOptionError, match="compress"):
        ckpt.save(tmp_path / "x", {"w": torch.ones(2)}, compress=["w"], options=SaveOptions(compress=True))
    # agreeing, or left at the default, is fine
    ckpt.save(tmp_path / "y", {"w": torch.ones(2)}, compress=True, options=SaveOptions(compress=True))
    ckpt.save(tmp_path / "z", {"w": torch.ones(2)}, compress=False, options=SaveOptions(dedup=True))


def test_write_part_refuses_options_that_belong_to_another_save(tmp_path: Path) -> None:
    pending = ckpt.begin(tmp_path / "p")
    with pytest.raises(SaveOptionError, match="overwrite"):
        ckpt.write_part(pending, "rank-00000", {"w": torch.ones(2)}, options=SaveOptions(overwrite=True))
    with pytest.raises(SaveOptionError, match="reuse=.*dedup_from|dedup_from.*reuse"):
        from ckpt.writer import Reuse

        ckpt.write_part(pending, "rank-00000", {"w": torch.ones(2)},
                        options=SaveOptions(dedup_from=str(tmp_path / "q"), reuse=Reuse(str(tmp_path / "q"), None)))  # type: ignore[arg-type]
    part = ckpt.write_part(pending, "rank-00000", {"w": torch.ones(2)}, options=SaveOptions(compress=True))
    ckpt.commit(pending, [part])
    assert torch.equal(ckpt.open(tmp_path / "p").tensor("w"), torch.ones(2))


@pytest.fixture
def one_rank_group(tmp_path: Path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg-store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _dtensor_state() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    return {"w": distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])}


def test_sharded_state_refuses_compress_and_dedup_by_name(tmp_path: Path, one_rank_group: None) -> None:
    state = _dtensor_state()
    out = tmp_path / "out"
    out.mkdir()
    # was: an untyped TypeError from the sharded save's signature
    with pytest.raises(SaveOptionError) as ei:
        ckpt.save(out / "s", state, compress=True)
    assert "compress=True" in str(ei.value) and "sharded" in str(ei.value)
    with pytest.raises(SaveOptionError, match="this_rank_only"):
        ckpt.save(out / "s", state, this_rank_only=True)
    assert _written(out) == []
    # was: a manager that silently wrote neither compressed nor deduplicated checkpoints
    with pytest.raises(SaveOptionError) as ei:
        ckpt.CheckpointManager(out / "run", state, compress=True, dedup=True, signals=(), ledger=False)
    assert ei.value.context["options"] == ["compress", "dedup"], ei.value.context
    assert "CheckpointManager" in str(ei.value)
    # what it supports still saves
    info = ckpt.save(out / "ok", state, step=1)
    assert info.step == 1 and ckpt.open(out / "ok").verify().files >= 1


def test_a_collective_save_refuses_this_rank_only(tmp_path: Path, one_rank_group: None) -> None:
    from ckpt.distributed import DistributedCheckpointer

    dc = DistributedCheckpointer()
    with pytest.raises(SaveOptionError, match="this_rank_only"):
        dc.save(tmp_path / "d", {"w": torch.ones(2)}, options=SaveOptions(this_rank_only=True))
    assert not (tmp_path / "d").exists()
    dc.save(tmp_path / "d", {"w": torch.ones(2)}, options=SaveOptions(compress=True, dedup=True))
    assert torch.equal(ckpt.open(tmp_path / "d").tensor("w"), torch.ones(2))
