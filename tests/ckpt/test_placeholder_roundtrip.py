"""Values the decoder reads as placeholders come back as themselves everywhere (issue 22
item 7): dtypes, devices and tensors as map keys, tensors in any context field, and
device indexes torch cannot hold refused instead of read back wrong."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import torch

import ckpt
from ckpt.errors import FormatError
from ckpt.format.tree import EXT_DEVICE, check_device, decode_tree


def test_dtype_device_and_tensor_keys_round_trip(tmp_path: Path) -> None:
    t = torch.arange(3.0)
    state = {"by_dtype": {torch.float16: 1, torch.int8: 2}, "by_device": {torch.device("cpu"): "here"},
             "by_tensor": {t: "w"}, "tuple_key": {(torch.bfloat16, "x"): 3}}
    ckpt.save(tmp_path / "c", {"s": state}, step=1)
    back = ckpt.open(tmp_path / "c").state()["s"]
    assert back["by_dtype"] == {torch.float16: 1, torch.int8: 2}
    assert back["by_device"] == {torch.device("cpu"): "here"}
    ((k, v),) = back["by_tensor"].items()
    assert isinstance(k, torch.Tensor) and torch.equal(k, t) and v == "w"
    assert back["tuple_key"] == {(torch.bfloat16, "x"): 3}


def test_a_tensor_in_the_data_context_is_returned_as_a_tensor(tmp_path: Path) -> None:
    order = torch.randperm(10, generator=torch.Generator().manual_seed(1))
    class Loader:  # a data source whose state holds a tensor (a shuffled order) and a dtype
        def state_dict(self):
            return {"order": order, "kind": torch.int64}

    ckpt.save(tmp_path / "c", {"w": torch.ones(2)}, step=1, data=Loader(), extra={"e": torch.zeros(3)})
    ctx = ckpt.open(tmp_path / "c").context()
    assert torch.equal(ctx["data"]["order"], order) and ctx["data"]["kind"] is torch.int64
    assert torch.equal(ctx["extra"]["e"], torch.zeros(3))


@pytest.mark.parametrize("text", ["cuda:0", "cuda:7", "cuda:99", "cuda:127", "privateuseone:127", "cpu"])
def test_device_indexes_torch_holds_read_back_exactly(text: str) -> None:
    assert check_device(text) == text
    from ckpt._materialize import _device

    assert str(_device(text, "p")).endswith(text.partition(":")[2])


@pytest.mark.parametrize("text", ["cuda:128", "cuda:255", "privateuseone:999999999", "cuda:01", "cuda:-1"])
def test_device_indexes_torch_cannot_hold_are_refused(text: str) -> None:
    """cuda:128 read back as cuda:-128 and privateuseone:999999999 lost its index."""
    doc = msgpack.packb({"state": {"d": msgpack.ExtType(EXT_DEVICE, text.encode())}, "context": {}}, use_bin_type=True)
    with pytest.raises(FormatError, match="invalid device string"):
        decode_tree(doc)
