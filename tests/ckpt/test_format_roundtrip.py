"""Round trips of the checkpoint format: every dtype, every view kind, every state kind.

Every comparison is bit-exact: tensors are compared as raw bytes (which also catches
-0.0 vs 0.0 and NaN payloads that ``torch.equal`` would blur) and with ``torch.equal``
where torch implements it for the dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckpt
from ckpt.context.config import config_hash
from ckpt.errors import ChecksumMismatchError, UnsupportedValueError
from ckpt.format import dtypes
from ckpt.format.manifest import MANIFEST_NAME, decode_manifest
from ckpt.knobs import override
from ckpt.storage import LocalStorage
from ckpt.writer import tensor_memoryview
import hangs

REPO = Path(__file__).resolve().parents[2]
CS = 4096  # the smallest chunk size a reader accepts: exercises chunk boundaries cheaply

# Dtypes torch has but the persisted table deliberately does not (sub-byte shells and
# quantized types). A new torch dtype must be added to the table or to this list.
KNOWN_UNSUPPORTED = {
    "bits1x8", "bits2x4", "bits4x2", "qint32", "qint8", "quint2x4", "quint4x2", "quint8",
    *(f"int{i}" for i in range(1, 8)), *(f"uint{i}" for i in range(1, 8)),
}


# --- helpers ---------------------------------------------------------------------------------


def raw(t: torch.Tensor) -> bytes:
    # keep the contiguous copy referenced while its memory is read: a memoryview over
    # a tensor's address does not keep the tensor alive
    c = t.detach().resolve_conj().resolve_neg().contiguous().cpu()
    return tensor_memoryview(c).tobytes()


def assert_bits_equal(a: Any, b: Any, where: str = "") -> None:
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
    assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
    assert raw(a) == raw(b), f"{where}: bytes differ"
    try:
        equal = torch.equal(a, b)
    except (NotImplementedError, RuntimeError):
        return  # no equal kernel for this dtype (bits16, complex32, ...): the bytes decided
    if not (a.is_floating_point() or a.is_complex()) or not bool(torch.isnan(a).any()):
        assert equal, where


def assert_same(a: Any, b: Any, where: str = "<root>") -> None:
    """Exact structural equality: types, keys, order of lists, float bits, tensor bytes."""
    if isinstance(a, torch.Tensor):
        assert_bits_equal(a, b, where)
        return
    if isinstance(a, dict) and isinstance(b, dict):  # OrderedDict travels as a plain map
        assert set(a) == set(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
        return
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{where}: {a!r} != {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def make(dtype_name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of the given dtype filled with arbitrary (but valid) bit patterns."""
    dt = dtypes.torch_dtype(dtype_name)
    n = math.prod(shape) * dtypes.itemsize(dtype_name)
    g = torch.Generator().manual_seed(seed)
    if dtype_name == "bool":
        return torch.randint(0, 2, shape, generator=g).bool()
    b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return b.view(dt).view(shape) if n else torch.empty(shape, dtype=dt)


def filled(t: torch.Tensor, byte: int = 0xA5) -> torch.Tensor:
    mv = tensor_memoryview(t)
    if len(mv):
        mv[:] = bytes([byte]) * len(mv)
    return t


def save(path: Path, state: Any, **kw: Any) -> ckpt.writer.CheckpointInfo:  # type: ignore[name-defined]
    kw.setdefault("code_dir", str(path.parent))
    with override(chunk_size=CS):
        return ckpt.save(path, state, **kw)


@pytest.fixture(autouse=True)
def _quiet_experimental_dtypes() -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
        warnings.filterwarnings("ignore", message="torch.quantize_per_tensor")
        yield


# --- dtypes ------------------------------------------------------------------------------------


def test_dtype_table_covers_every_storable_torch_dtype() -> None:
    have = {str(v)[len("torch.") :] for v in vars(torch).values() if isinstance(v, torch.dtype)}
    missing = have - set(dtypes.DTYPES) - KNOWN_UNSUPPORTED
    assert not missing, f"torch dtypes neither in the table nor known-unsupported: {sorted(missing)}"
    for name in dtypes.DTYPES:
        assert dtypes.dtype_name(dtypes.torch_dtype(name)) == name
        assert dtypes.torch_dtype(name).itemsize == dtypes.itemsize(name)


SHAPES = [(), (0,), (3, 0, 2), (7,), (5, 3), (3000,)]  # (3000,) crosses 4 KiB chunks for wide dtypes


def test_every_dtype_and_shape_round_trips_bit_exactly(tmp_path: Path) -> None:
    import safetensors.torch

    state: dict[str, torch.Tensor] = {}
    for i, name in enumerate(dtypes.DTYPES):
        for j, shape in enumerate(SHAPES):
            state[f"{name}/{j}"] = make(name, shape, seed=100 * i + j)
    p = tmp_path / "c"
    save(p, {"w": state})
    r = ckpt.open(p)
    fresh = r.state()["w"]
    assert set(fresh) == set(state)
    for key, t in state.items():
        assert_bits_equal(fresh[key], t, key)
        assert_bits_equal(r.tensor(f"w/{key.replace('/', '%2F')}"), t, f"lazy {key}")
    # in place: into tensors of the right dtype and shape, pre-filled with 0xA5; storage is kept
    target = {k: filled(torch.empty(v.shape, dtype=v.dtype)) for k, v in state.items()}
    ptrs = {k: v.data_ptr() for k, v in target.items()}
    res = ckpt.load(p, {"w": target})
    assert res.fresh == 0 and res.in_place == len(state)
    for key, t in state.items():
        assert_bits_equal(target[key], t, f"in place {key}")
        if t.numel():
            assert target[key].data_ptr() == ptrs[key]
    # stock safetensors reads the file: native dtypes as themselves, the rest as raw U8
    stock = safetensors.torch.load_file(str(p / "rank-00000.safetensors"))
    for key, t in state.items():
        name = key.split("/")[0]
        got = stock[f"w/{key.replace('/', '%2F')}"]
        if dtypes.is_raw(name):
            assert got.dtype == torch.uint8 and raw(got) == raw(t), key
        else:
            assert_bits_equal(got, t, f"stock {key}")


@pytest.mark.parametrize("name", sorted(set(KNOWN_UNSUPPORTED) - {"qint32", "qint8", "quint2x4", "quint4x2", "quint8"}))
def test_unstorable_dtype_raises_type_error_naming_the_key(tmp_path: Path, name: str) -> None:
    t = torch.empty(4, dtype=getattr(torch, name))
    with pytest.raises(UnsupportedValueError, match=r"key 'm/deep/x'") as ei:
        save(tmp_path / "c", {"m": {"deep": {"x": t}}})
    assert isinstance(ei.value, TypeError) and name in str(ei.value)
    assert os.listdir(tmp_path) == []  # nothing committed, temporary directory removed


def test_quantized_and_sparse_tensors_are_refused(tmp_path: Path) -> None:
    q = torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.quint8)
    with pytest.raises(UnsupportedValueError, match=r"key 'a/q'"):
        save(tmp_path / "c", {"a": {"q": q}})
    with pytest.raises(UnsupportedValueError, match=r"layout.*key 'a/s'"):
        save(tmp_path / "c", {"a": {"s": torch.eye(3).to_sparse()}})


# --- views, aliasing ------------------------------------------------------------------------------


def test_non_contiguous_conj_and_neg_views(tmp_path: Path) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    c = torch.randn(4, 3, dtype=torch.complex64)
    x = torch.randn(5, dtype=torch.float64)
    views = {
        "base": base,
        "transposed": base.t(),
        "strided": base[1::2, ::3],
        "column": base[:, 4],
        "expanded": torch.tensor([1.5, -2.5]).expand(3, 2),
        "c": c,
        "conj": c.conj(),
        "conj_t": c.t().conj(),
        "x": x,
        "neg": torch._neg_view(x),
    }
    assert views["conj"].is_conj() and views["neg"].is_neg() and not views["transposed"].is_contiguous()
    p = tmp_path / "c"
    save(p, {"v": views})
    fresh = ckpt.open(p).state()["v"]
    for k, v in views.items():
        assert_bits_equal(fresh[k], v.resolve_conj().resolve_neg(), k)
        assert torch.equal(fresh[k], v), k
        assert fresh[k].is_contiguous() and not fresh[k].is_conj() and not fresh[k].is_neg()
    # x and x.conj() share storage, offset and strides: they must still be two entries
    keys = [t.key for t in ckpt.open(p).part().tensors]
    assert {"v/conj", "v/neg", "v/c", "v/x"} <= set(keys)


def test_in_place_load_into_views_writes_the_values_not_the_bytes(tmp_path: Path) -> None:
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    x = torch.tensor([1.0, -2.0, 0.5])
    y = torch.arange(12.0)
    p = tmp_path / "c"
    save(p, {"s": {"c": c, "x": x, "y": y}})
    target = {
        "c": torch.zeros(2, dtype=torch.complex64).conj(),
        "x": torch._neg_view(torch.zeros(3)),
        "y": torch.zeros(12, 2)[:, 1],  # non-contiguous: filled through copy_
    }
    kept = dict(target)
    ckpt.load(p, {"s": target})
    for k, want in (("c", c), ("x", x), ("y", y)):
        assert target[k] is kept[k]
        assert torch.equal(target[k], want), k


def test_tied_weights_are_stored_once_and_restored_as_one_object(tmp_path: Path) -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    torch.manual_seed(0)
    m = Tied()
    p = tmp_path / "c"
    save(p, {"model": m, "also": {"w": m.emb.weight, "w_again": m.head.weight}})
    r = ckpt.open(p)
    keys = [t.key for t in r.part().tensors]
    assert keys == ["model/emb.weight"], keys  # one entry for four references
    assert r.part().summary["entries"]["model"]["tensors"] == 1
    fresh = r.state()
    w = fresh["model"]["emb.weight"]
    assert fresh["model"]["head.weight"] is w and fresh["also"]["w"] is w and fresh["also"]["w_again"] is w
    assert_bits_equal(w, m.emb.weight.detach(), "tied")
    # in place into a fresh tied model: the tie survives and holds the saved values
    torch.manual_seed(1)
    m2 = Tied()
    ckpt.load(p, {"model": m2})
    assert m2.head.weight is m2.emb.weight
    assert_bits_equal(m2.emb.weight.detach(), m.emb.weight.detach(), "in place tied")


def test_overlapping_but_different_views_are_stored_separately(tmp_path: Path) -> None:
    t = torch.arange(12, dtype=torch.int16)
    state = {"full": t, "head": t[:6], "odd": t[1::2], "same_again": t.view(12)}
    p = tmp_path / "c"
    save(p, {"s": state})
    r = ckpt.open(p)
    assert sorted(e.key for e in r.part().tensors) == ["s/full", "s/head", "s/odd"]
    fresh = r.state()["s"]
    for k, v in state.items():
        assert_bits_equal(fresh[k], v, k)
    assert fresh["same_again"] is fresh["full"]  # an identical view is an alias


def test_paths_that_render_alike_get_distinct_tensor_keys(tmp_path: Path) -> None:
    state = {1: torch.ones(2), "1": torch.zeros(2), "1~1": torch.full((2,), 2.0), "a/b": torch.ones(1), "a": {"b": torch.zeros(1)}}
    p = tmp_path / "c"
    save(p, {"t": state})
    r = ckpt.open(p)
    keys = [e.key for e in r.part().tensors]
    assert len(set(keys)) == len(keys) == 5
    assert_same(r.state()["t"], state)


def test_distinct_empty_tensors_are_not_merged(tmp_path: Path) -> None:
    state = {"a": torch.empty(0), "b": torch.empty(0, 3, dtype=torch.int8), "c": torch.empty(0)}
    p = tmp_path / "c"
    save(p, {"e": state})
    fresh = ckpt.open(p).state()["e"]
    for k, v in state.items():
        assert_bits_equal(fresh[k], v, k)
    assert fresh["a"] is not fresh["c"]


# --- plain values -----------------------------------------------------------------------------------


NAN_PAYLOAD = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0]
NEG_NAN = struct.unpack("<d", struct.pack("<Q", 0xFFF0_0000_0000_0001))[0]


def plain_tree() -> dict[str, Any]:
    return {
        "none": None,
        "bools": [True, False],
        "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1],
        "bigints": [2**64, -(2**63) - 1, 2**200, -(3**150)],
        "floats": [0.0, -0.0, 1.5, math.inf, -math.inf, NAN_PAYLOAD, NEG_NAN, 5e-324, 0.1],
        "str": "héllo \x00 wörld",
        "bytes": b"\x00\xff" * 17,
        "tuple": (1, (2.5, "x"), [None, (b"",)]),
        "empty": {"d": {}, "l": [], "t": ()},
        "int_keys": {0: "zero", -5: "neg", 2**40: "big"},
        "mixed_keys": {1: "one", "1": "string one", 1.5: "float", None: "nil", False: "bool"},
        "tuple_keys": {(1, 2): "pair"},
        "deep": [[[[[{"x": [1, [2, [3]]]}]]]]],
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "size": torch.Size([3, 4]),
        "tensor_in_list": [torch.tensor([1, 2]), {"t": torch.tensor(3.0)}],
    }


def test_nested_plain_values_round_trip_exactly(tmp_path: Path) -> None:
    tree = plain_tree()
    p = tmp_path / "c"
    save(p, {"t": tree}, extra={"note": "extra survives", "n": 2**70})
    r = ckpt.open(p)
    got = r.state()["t"]
    want = dict(tree)
    want["size"] = (3, 4)  # torch.Size is a tuple on the wire and comes back as one
    assert_same(got, want)
    assert [type(k) for k in got["mixed_keys"]] == [int, str, float, type(None), bool]
    # in place into a plain dict: values replaced, keys added
    target: dict[str, Any] = {"none": "will be replaced"}
    res = ckpt.load(p, {"t": target})
    assert_same(target, want)
    assert_same(res.extra, {"note": "extra survives", "n": 2**70})
    empty: dict[str, Any] = {}
    ckpt.load(p, {"t": empty})
    assert_same(empty, want)  # a saved None creates its key too


@pytest.mark.parametrize(
    "bad, where",
    [
        ({"a": {"b": {1, 2}}}, "a/b"),
        ({"a": [0, object()]}, "a/1"),
        ({"a": {"fn": lambda: 1}}, "a/fn"),
        ({"a": {"k": (1, frozenset())}}, "a/k/1"),
        ({"a": {"c": complex(1, 2)}}, "a/c"),
    ],
)
def test_unsupported_values_raise_type_error_naming_the_key_path(tmp_path: Path, bad: Any, where: str) -> None:
    with pytest.raises(UnsupportedValueError) as ei:
        save(tmp_path / "c", bad)
    e = ei.value
    assert isinstance(e, TypeError) and e.key == where and f"key '{where}'" in str(e)
    assert os.listdir(tmp_path) == []


def test_unsupported_values_in_extra_and_data_name_their_key(tmp_path: Path) -> None:
    class Loader:
        def state_dict(self) -> dict[str, Any]:
            return {"pos": 3, "cb": print}

        def load_state_dict(self, sd: Any) -> None:  # pragma: no cover - never reached
            pass

    with pytest.raises(UnsupportedValueError, match=r"key '@extra/x'"):
        save(tmp_path / "a", {}, extra={"x": {1}})
    with pytest.raises(UnsupportedValueError, match=r"key '@data/cb'"):
        save(tmp_path / "b", {}, data=Loader())
    with pytest.raises(UnsupportedValueError, match=r"top-level"):
        save(tmp_path / "c", {3: {}})


# --- optimizers, schedulers, scaler --------------------------------------------------------------------


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _warmup_cosine(step: int) -> float:
    return min(1.0, (step + 1) / 5) * 0.5 * (1 + math.cos(math.pi * step / 40))


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
}


def _schedulers(opt: torch.optim.Optimizer) -> dict[str, Any]:
    # Three optimizers' worth of schedulers on one optimizer would fight; each gets
    # its own SGD sharing nothing but the recipe.
    ps = [torch.nn.Parameter(torch.zeros(2))]
    o1, o2 = torch.optim.SGD(ps, lr=0.1, momentum=0.9), torch.optim.SGD(ps, lr=0.1)
    return {
        "lambda": torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine),
        "onecycle": torch.optim.lr_scheduler.OneCycleLR(o1, max_lr=1.0, total_steps=50),
        "sequential": torch.optim.lr_scheduler.SequentialLR(
            o2,
            [torch.optim.lr_scheduler.LinearLR(o2, 0.1, total_iters=3), torch.optim.lr_scheduler.CosineAnnealingLR(o2, 10)],
            milestones=[3],
        ),
        "_opts": (o1, o2),
    }


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, scheds: dict[str, Any], scaler: Any, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        for name, s in scheds.items():
            if name != "_opts":
                if name != "lambda":
                    s.optimizer.step()
                s.step()


def _snapshot(obj: Any) -> Any:
    """A deep copy: state_dict() tensors alias live parameters that training mutates."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, _snapshot(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(v) for v in obj)
    return obj


def _full_state(model: Any, opt: Any, scheds: dict[str, Any], scaler: Any) -> dict[str, Any]:
    out = {"model": model.state_dict(), "optim": opt.state_dict(), "scaler": scaler.state_dict()}
    out.update(optim_onecycle=scheds["_opts"][0].state_dict(), optim_seq=scheds["_opts"][1].state_dict())
    out.update({k: v.state_dict() for k, v in scheds.items() if k != "_opts"})
    return out


def _stateful_map(model: Any, opt: Any, scheds: dict[str, Any], scaler: Any) -> dict[str, Any]:
    m = {"model": model, "optim": opt, "scaler": scaler, "optim_onecycle": scheds["_opts"][0], "optim_seq": scheds["_opts"][1]}
    m.update({k: v for k, v in scheds.items() if k != "_opts"})
    return m


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_optimizer_scheduler_scaler_restore_bit_exactly(tmp_path: Path, opt_name: str) -> None:
    model = _model(0)
    opt = OPTIMIZERS[opt_name](model.parameters())
    scheds = _schedulers(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    _train(model, opt, scheds, scaler, steps=7, seed=1)
    saved = _snapshot(_full_state(model, opt, scheds, scaler))
    p = tmp_path / "c"
    save(p, _stateful_map(model, opt, scheds, scaler), step=7)
    # the reference continuation
    _train(model, opt, scheds, scaler, steps=3, seed=2)
    reference = _snapshot(_full_state(model, opt, scheds, scaler))

    # 1) fresh objects, no state yet
    m1 = _model(99)
    o1 = OPTIMIZERS[opt_name](m1.parameters())
    s1 = _schedulers(o1)
    sc1 = torch.amp.GradScaler("cpu")
    res = ckpt.load(p, _stateful_map(m1, o1, s1, sc1))
    assert res.step == 7
    assert_same(_full_state(m1, o1, s1, sc1), saved)
    _train(m1, o1, s1, sc1, steps=3, seed=2)
    assert_same(_full_state(m1, o1, s1, sc1), reference)

    # 2) objects that already have (different) state: every tensor is overwritten
    m2 = _model(5)
    o2 = OPTIMIZERS[opt_name](m2.parameters())
    s2 = _schedulers(o2)
    sc2 = torch.amp.GradScaler("cpu", init_scale=4.0)
    _train(m2, o2, s2, sc2, steps=4, seed=3)
    ckpt.load(p, _stateful_map(m2, o2, s2, sc2))
    assert_same(_full_state(m2, o2, s2, sc2), saved)
    _train(m2, o2, s2, sc2, steps=3, seed=2)
    assert_same(_full_state(m2, o2, s2, sc2), reference)

    # 3) fresh load into plain trees: the saved state dicts, exactly
    fresh = ckpt.open(p).state()
    for k, v in saved.items():
        assert_same(fresh[k], v, k)


# --- lazy reads, map_location ------------------------------------------------------------------------


class CountingStorage(LocalStorage):
    def __init__(self) -> None:
        self.reads: list[tuple[str, int, int]] = []

    def pread_into(self, path: str, offset: int, buf: memoryview) -> int:
        self.reads.append((os.path.basename(path), offset, len(buf)))
        return super().pread_into(path, offset, buf)


def _three_tensor_ckpt(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    ts = {
        # 5 chunks' worth each; after the header none is chunk-aligned, so each spans 6
        "a": torch.arange(5 * CS // 4, dtype=torch.float32),
        "b": torch.arange(5 * CS // 8, dtype=torch.float64) * -1.5,
        "c": torch.arange(5 * CS // 2, dtype=torch.int16),
    }
    p = tmp_path / "c"
    save(p, {"w": ts})
    return p, ts


def test_lazy_tensor_reads_only_the_chunks_it_overlaps(tmp_path: Path) -> None:
    p, ts = _three_tensor_ckpt(tmp_path)
    storage = CountingStorage()
    r = ckpt.open(p, storage=storage)
    assert all(name == MANIFEST_NAME for name, _, _ in storage.reads)  # opening reads MANIFEST only
    storage.reads.clear()
    # the tensor in the middle of the file (the writer orders tensors by element size)
    e = sorted(r.part().tensors, key=lambda t: t.offset)[1]
    got = r.tensor(e.key)
    assert_bits_equal(got, ts[e.key.split("/")[1]], e.key)
    f = r.part().files[e.file]
    lo = e.offset // CS * CS
    hi = min(((e.offset + e.nbytes - 1) // CS + 1) * CS, f.size)
    header_end = min(t.offset for t in r.part().tensors)
    total = 0
    for name, off, n in storage.reads:
        assert name == f.name, f"read {name}: lazy tensor read must not touch other files"
        assert off + n <= header_end or (lo <= off and off + n <= hi), (off, n, lo, hi)
        if off >= lo:
            total += n
    assert total == hi - lo and hi - lo < f.size - header_end  # far less than the whole data


def test_lazy_read_of_one_tensor_ignores_corruption_elsewhere(tmp_path: Path) -> None:
    p, ts = _three_tensor_ckpt(tmp_path)
    r = ckpt.open(p)
    ec = next(t for t in r.part().tensors if t.key == "w/c")
    fname = r.part().files[ec.file].name
    bad = ec.offset + ec.nbytes - 10  # the last chunk of c, shared with no other tensor
    with open(p / fname, "r+b") as fh:
        fh.seek(bad)
        byte = fh.read(1)
        fh.seek(bad)
        fh.write(bytes([byte[0] ^ 0x10]))
    r = ckpt.open(p)
    assert_bits_equal(r.tensor("w/a"), ts["a"], "a")
    assert_bits_equal(r.tensor("w/b"), ts["b"], "b")
    with pytest.raises(ChecksumMismatchError, match=rf"file .*{fname}.*offset {bad // CS * CS}.*key 'w/c'"):
        r.tensor("w/c")
    # the opt-out returns the stored bytes as they are
    assert not torch.equal(r.tensor("w/c", verify=False), ts["c"])


def test_map_location_for_fresh_and_in_place_loads(tmp_path: Path) -> None:
    p, ts = _three_tensor_ckpt(tmp_path)
    r = ckpt.open(p)
    meta = r.state(map_location="meta")["w"]
    assert all(v.device.type == "meta" and v.shape == ts[k].shape for k, v in meta.items())
    assert r.tensor("w/a", map_location=torch.device("meta")).device.type == "meta"
    seen: list[str] = []

    def where(t: torch.Tensor) -> torch.Tensor:
        seen.append(str(t.device))
        return t.to("cpu")

    for k, v in r.state(map_location=where)["w"].items():
        assert_bits_equal(v, ts[k], k)
    assert seen == ["cpu"] * 3
    # in place: existing tensors keep their storage; missing ones are created and moved
    a = torch.zeros_like(ts["a"])
    target: dict[str, Any] = {"a": a}
    ckpt.load(p, {"w": target}, map_location="meta")
    assert target["a"] is a
    assert_bits_equal(a, ts["a"], "a")
    assert target["b"].device.type == "meta" and target["c"].device.type == "meta"


# --- RNG ------------------------------------------------------------------------------------------------


def _draws(gen: torch.Generator) -> list[Any]:
    return [random.random(), random.getrandbits(80), np.random.rand(3).tolist(), torch.rand(4), torch.randn(3, generator=gen)]


def test_rng_streams_restore_exactly(tmp_path: Path) -> None:
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    gen = torch.Generator().manual_seed(14)
    random.random(), np.random.randn(), torch.rand(1), torch.rand(1, generator=gen)  # advance past seeding
    p = tmp_path / "c"
    save(p, {}, generators={"gen": gen})
    expected = _draws(gen)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    gen.manual_seed(0)
    res = ckpt.load(p, {}, generators={"gen": gen})
    assert set(res.restored_rng) >= {"python", "numpy", "torch_cpu", "generator:gen"}
    got = _draws(gen)
    assert_same(got, expected)
    # restore_rng=False leaves the streams alone
    before = random.getstate()
    ckpt.load(p, {}, restore_rng=False)
    assert random.getstate() == before


def test_save_does_not_consume_random_draws(tmp_path: Path) -> None:
    random.seed(3)
    torch.manual_seed(3)
    state = (random.getstate(), torch.get_rng_state())
    save(tmp_path / "c", {"w": {"t": torch.ones(3)}})
    assert random.getstate() == state[0] and torch.equal(torch.get_rng_state(), state[1])


# --- config, commit -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Cfg:
    lr: float
    layers: list[int]
    name: str
    nested: dict[str, Any]


def test_config_hash_is_canonical_across_types_and_exact_for_floats(tmp_path: Path) -> None:
    content = {"lr": 0.1, "layers": [4, 8], "name": "run", "nested": {"b": 1, "a": (2, 3)}}
    as_dict = dict(reversed(list(content.items())))
    as_dc = Cfg(**content)
    as_ns = argparse.Namespace(**content)
    hashes = {config_hash(c) for c in (content, as_dict, as_dc, as_ns)}
    assert len(hashes) == 1 and next(iter(hashes)).startswith("sha256:")
    assert config_hash({**content, "lr": 0.1000000000000001}) not in hashes
    assert config_hash({**content, "lr": 1}) != config_hash({**content, "lr": 1.0})
    # through a checkpoint: the canonical bytes and the hash are stored
    save(tmp_path / "a", {}, config=as_ns)
    save(tmp_path / "b", {}, config=as_dc)
    ca, cb = ckpt.open(tmp_path / "a").context()["config"], ckpt.open(tmp_path / "b").context()["config"]
    assert ca == cb and ca["hash"] in hashes
    assert ckpt.open(tmp_path / "a").part().summary["config_hash"] == ca["hash"]


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@e"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def test_commit_field_with_clean_and_dirty_git_and_without_git(tmp_path: Path) -> None:
    for state in ("clean", "dirty"):
        repo = tmp_path / f"repo-{state}"
        repo.mkdir()
        _git(repo, "init", "-q")
        (repo / "train.py").write_text("print(1)\n")
        _git(repo, "add", "train.py")
        _git(repo, "commit", "-qm", "init")
        if state == "dirty":
            (repo / "train.py").write_text("print(2)\n")
        save(tmp_path / f"c-{state}", {}, code_dir=str(repo))
        c = ckpt.open(tmp_path / f"c-{state}").context()["commit"]
        assert c["available"] is True and c["sha"] == _git(repo, "rev-parse", "HEAD")
        assert re.fullmatch(r"[0-9a-f]{40}", c["sha"])
        assert c["dirty"] is (state == "dirty")
        assert (c["diff_sha256"] is None) is (state == "clean")
    plain = tmp_path / "not-a-repo"
    plain.mkdir()
    save(tmp_path / "c-none", {}, code_dir=str(plain))
    c = ckpt.open(tmp_path / "c-none").context()["commit"]
    assert c["available"] is False and c["sha"] is None and "not a git checkout" in c["reason"]


# --- determinism ------------------------------------------------------------------------------------------------


def test_same_state_saves_to_identical_bytes_apart_from_created_at(tmp_path: Path) -> None:
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt, "tree": plain_tree()}
    infos = [save(tmp_path / name, state, step=3, config={"lr": 0.1}, extra=[1, 2]) for name in ("a", "b")]
    assert infos[0].id == infos[1].id
    names = sorted(os.listdir(tmp_path / "a"))
    assert names == sorted(os.listdir(tmp_path / "b"))
    for n in names:
        if n != MANIFEST_NAME:
            assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes(), n
    ma, mb = (decode_manifest((tmp_path / x / MANIFEST_NAME).read_bytes()) for x in ("a", "b"))
    assert dataclasses.replace(ma, created_at=0.0) == dataclasses.replace(mb, created_at=0.0)


# --- hygiene: no pickle, torch-free imports --------------------------------------------------------------------


PICKLE_RE = re.compile(r"^\s*(import|from)\s+(pickle|_pickle|cPickle|cloudpickle|dill|marshal|shelve)\b|torch\.load\(|torch\.save\(", re.M)


# The one documented exception (spec/sharded-format.md §S.6): importing a DCP checkpoint
# reads its pickled .metadata with an allowlist unpickler and its items with
# torch.load(weights_only=True). Tested in tests/ckpt/test_dcp_interop.py.
PICKLE_ALLOWED = {"ckpt/dcp/interop.py"}


def test_no_module_in_ckpt_imports_pickle() -> None:
    offenders = []
    for root in ("ckpt", "cli"):
        for f in sorted((REPO / root).rglob("*.py")):
            if str(f.relative_to(REPO)) in PICKLE_ALLOWED:
                continue
            if PICKLE_RE.search(f.read_text()):
                offenders.append(str(f.relative_to(REPO)))
    assert offenders == []


def test_save_and_load_never_call_pickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("pickle was used")

    for name in ("dump", "dumps", "load", "loads", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    p = tmp_path / "c"
    save(p, {"model": model, "optim": opt}, config={"a": 1})
    ckpt.load(p, {"model": _model(1), "optim": torch.optim.AdamW(_model(1).parameters())})
    ckpt.open(p).state()
    ckpt.open(p).verify()


def _subprocess(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = hangs.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, bound_s=hangs.hang_s(12))
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.timeout(120)
def test_import_ckpt_and_cli_and_read_without_torch(tmp_path: Path) -> None:
    p = tmp_path / "c"
    save(p, {"w": {"t": torch.arange(3000)}}, step=5)
    out = _subprocess(
        "import sys, ckpt, ckpt_cli.main\n"
        "assert 'torch' not in sys.modules, 'import pulled in torch'\n"
        f"r = ckpt.open({str(p)!r}); r.verify(); ctx = r.context()\n"
        "assert 'torch' not in sys.modules, 'open/verify/context pulled in torch'\n"
        "print(r.step, ctx['step'])\n"
    )
    assert out.split() == ["5", "5"]


# --- nesting: what the writer accepts, the reader reads (and neither crashes) ------------------------------------


@pytest.mark.parametrize("kind", ["tuple", "list", "dict"])
def test_deepest_nesting_the_writer_accepts_reads_back(tmp_path: Path, kind: str) -> None:
    wrap = {"tuple": lambda x: (x,), "list": lambda x: [x], "dict": lambda x: {"k": x}}[kind]
    deepest: Any = 7
    for _ in range(256):  # knobs.max_nesting
        deepest = wrap(deepest)
    p = tmp_path / "c"
    save(p, {"t": {"x": torch.ones(1)}, "deep": deepest}, extra=deepest)
    r = ckpt.open(p)
    assert r.state()["deep"] == deepest and ckpt.load(p, {}).extra == deepest
    with pytest.raises(UnsupportedValueError, match="nests too deeply"):
        save(tmp_path / "d", {"deep": wrap(deepest)})


def test_mmap_fresh_load_is_exact_private_and_verified(tmp_path):
    """state(mmap=True): every dtype exact, writes stay private, corruption still refused."""
    import ckpt.format.dtypes as dt_table
    from ckpt.errors import ChecksumMismatchError

    tensors = {}
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int8", "uint8", "bool", "complex64", "complex128"):
        d = getattr(torch, name)
        t = (torch.arange(7 * 3) % 5).to(torch.float64).reshape(7, 3)
        tensors[name] = (t > 2) if d is torch.bool else t.to(d)
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.empty(0, 4)
    ckpt.save(tmp_path / "c", {"s": tensors}, step=0)
    before = (tmp_path / "c" / "rank-00000.safetensors").read_bytes()
    got = ckpt.open(tmp_path / "c").state(unsafe_mmap=True)["s"]
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    got["float32"].add_(1)  # copy-on-write: the file must not change
    assert (tmp_path / "c" / "rank-00000.safetensors").read_bytes() == before
    assert set(dt_table.DTYPES) >= {str(v.dtype)[6:] for v in tensors.values()}
    raw = bytearray(before)
    raw[-2] ^= 1
    (tmp_path / "c" / "rank-00000.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError):
        ckpt.open(tmp_path / "c").state(unsafe_mmap=True)


def test_parallel_unverified_reads_are_exact(tmp_path, monkeypatch):
    """Large parts read without verification split reads over two threads; bits unchanged."""
    import ckpt._ranges as reader_mod

    monkeypatch.setattr(reader_mod, "PIPELINE_MIN_BYTES", 0)
    with ckpt.knobs.override(read_request=4096):
        ts = {"a": torch.randn(10_001, dtype=torch.float64), "b": torch.arange(7777, dtype=torch.int16), "c": torch.randn(3, 5)}
        ckpt.save(tmp_path / "c", {"w": ts}, step=0)
        target = {"w": {k: torch.zeros_like(v) for k, v in ts.items()}}
        ckpt.load(tmp_path / "c", target, verify=False, restore_rng=False, exactness="off")
        for k in ts:
            assert torch.equal(target["w"][k], ts[k]), k
        fresh = ckpt.open(tmp_path / "c").state(verify=False)["w"]
        for k in ts:
            assert torch.equal(fresh[k], ts[k]), k


def test_overlapped_digests_equal_inline_digests(tmp_path, monkeypatch):
    """Hashing large writes on a second thread gives exactly the inline digests."""
    import ckpt.storage.posix as storage_mod

    ts = {"a": torch.randn(70_000), "b": torch.arange(5, dtype=torch.int8), "c": torch.randn(33_333, dtype=torch.float64)}
    with ckpt.knobs.override(chunk_size=4096):
        inline = ckpt.save(tmp_path / "inline", {"w": ts}, step=0).manifest
        monkeypatch.setattr(storage_mod, "_OVERLAP_MIN", 0)
        overlapped = ckpt.save(tmp_path / "overlap", {"w": ts}, step=0).manifest
    assert [f.digests for f in inline.files] == [f.digests for f in overlapped.files]
    assert inline.id == overlapped.id
    ckpt.open(tmp_path / "overlap").verify()
