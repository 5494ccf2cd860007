"""CUDA paths: RNG state of every device, map_location, in-place load into device tensors.

Marked ``cuda``: skipped where no CUDA device exists (CI has none); run on the GPU
machine with ``pytest -m cuda``.
"""

from __future__ import annotations

import pytest
import torch

import ckpt

pytestmark = pytest.mark.cuda


def test_cuda_rng_of_every_device_round_trips(tmp_path):
    torch.cuda.init()
    torch.manual_seed(7)
    n = torch.cuda.device_count()
    [torch.rand(3, device=f"cuda:{i}") for i in range(n)]  # advance each device's Philox offset
    ckpt.save(tmp_path / "c", {"x": {"w": torch.zeros(2)}}, step=0)
    expected = [torch.rand(5, device=f"cuda:{i}") for i in range(n)]
    info = ckpt.load(tmp_path / "c", {"x": {"w": torch.zeros(2)}})
    assert f"cuda x{n}" in info.restored_rng
    again = [torch.rand(5, device=f"cuda:{i}") for i in range(n)]
    for a, b in zip(expected, again):
        assert torch.equal(a, b)
    assert len(info.context["rng"]["cuda"]) == n


def test_cuda_generator_registered_round_trips(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(3)
    torch.rand(4, device="cuda", generator=g)
    ckpt.save(tmp_path / "c", {"x": {}}, generators={"aug": g}, step=0)
    want = torch.rand(4, device="cuda", generator=g)
    ckpt.load(tmp_path / "c", {"x": {}}, generators={"aug": g})
    assert torch.equal(torch.rand(4, device="cuda", generator=g), want)


def test_cuda_tensors_save_and_load_in_place_and_fresh(tmp_path):
    model = torch.nn.Linear(16, 8).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16, device="cuda")).sum().backward()
    opt.step()
    ckpt.save(tmp_path / "c", {"model": model, "optim": opt}, step=1)
    model2 = torch.nn.Linear(16, 8).cuda()
    opt2 = torch.optim.AdamW(model2.parameters())
    ckpt.load(tmp_path / "c", {"model": model2, "optim": opt2})
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert b.is_cuda and torch.equal(a, b)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    for i in s1:
        for k in s1[i]:
            assert torch.equal(s1[i][k].cpu(), s2[i][k].cpu())
    fresh = ckpt.open(tmp_path / "c").state(map_location="cuda:0")
    assert fresh["model"]["weight"].device.type == "cuda"
    assert torch.equal(fresh["model"]["weight"], model.weight.detach())


def test_rng_state_restores_after_map_location_cuda(tmp_path):
    # RNG state must stay a CPU ByteTensor whatever map_location says (ignite#2076).
    torch.manual_seed(1)
    ckpt.save(tmp_path / "c", {"x": {"w": torch.ones(2)}}, step=0)
    want = torch.rand(3)
    ckpt.load(tmp_path / "c", {"x": {"w": torch.ones(2)}}, map_location="cuda:0")
    assert torch.equal(torch.rand(3), want)
