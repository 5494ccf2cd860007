"""In-place load is all or nothing; restores that cannot take effect and silent casts are errors;
``verify`` accepts only what ``load`` can load; ``resume()`` falls back past any checkpoint that
does not load (issue: no silent wrong data, items 1-4)."""

from __future__ import annotations

import os
import random
import sys
import warnings
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

import ckpt
from ckpt.errors import (
    CheckpointChangedError,
    ChecksumMismatchError,
    FormatError,
    MissingFileError,
    ResumeMismatchError,
    StateMismatchError,
)
from ckpt.format.codec import zstd_compress, zstd_decompress
from ckpt.format.tree import EXT_DEVICE, EXT_TENSOR
from ckpt.knobs import override
from ckpt.manager import CheckpointManager, ResumeFallbackWarning
from ckpt.reader import CheckpointReader
from tests.ckpt.test_format_bad_input import CS, SF, ST, flip, manifest_of, reseal
import hangs

REPO = Path(__file__).resolve().parents[2]


def _model_opt(seed: int, width: int = 24) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.LayerNorm(width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    o = torch.optim.AdamW(m.parameters(), lr=0.01)
    for _ in range(2):
        o.zero_grad()
        m(torch.randn(8, 16)).pow(2).mean().backward()
        o.step()
    return m, o


def _snapshot(*objs: Any) -> list[tuple[str, Any]]:
    """Every tensor and value the targets hold, plus the RNG streams, copied."""
    out: list[tuple[str, Any]] = []

    def walk(x: Any, where: str) -> None:
        if isinstance(x, torch.Tensor):
            out.append((where, x.detach().clone()))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{where}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{where}/{i}")
        else:
            out.append((where, x))

    for i, o in enumerate(objs):
        walk(o.state_dict() if hasattr(o, "state_dict") else o, str(i))
    out.append(("rng/torch", torch.get_rng_state()))
    out.append(("rng/python", random.getstate()))
    return out


def _assert_same(before: list[tuple[str, Any]], *objs: Any) -> None:
    after = _snapshot(*objs)
    assert [k for k, _ in before] == [k for k, _ in after]
    for (k, a), (_, b) in zip(before, after):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f"{k} changed by a failed load"
        else:
            assert a == b, f"{k} changed by a failed load"


def _save(path: Path, state: dict[str, Any], **kw: Any) -> Path:
    with override(chunk_size=CS):
        ckpt.save(path, state, step=1, code_dir=str(path.parent), **kw)
    return path


# --- 1. all or nothing ----------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True], ids=["in-order", "two-threads"])
def test_a_bit_flip_in_any_chunk_of_any_tensor_file_leaves_every_target_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """Three model+AdamW checkpoints, three flipped bits per 4 KiB chunk of each tensor file
    (one at a time, a different byte each time): every load raises and every target, RNG stream included, is
    bit-identical to before. (Before: the model held the corrupt bytes of every tensor read
    before the bad chunk; one weight came back as -1.8e36.) ``two-threads``: small files take
    the path of large ones, hashed and copied by two threads taking one-chunk pieces in turn;
    the chunk named is still the flipped one, and the error is that mismatch (a traceback
    that kept a slice of the mapping once made unmapping it raise ``BufferError`` instead,
    for files of 32 MiB and more corrupt in their first half)."""
    shares: list[int] = []
    if shared:
        from ckpt import _ranges

        monkeypatch.setattr(_ranges, "PIPELINE_MIN_BYTES", 0)
        monkeypatch.setattr(_ranges, "SHARED_PIECE", CS)
        real_share = _ranges.share
        monkeypatch.setattr(_ranges, "share", lambda calls: (shares.append(len(calls)), real_share(calls))[1])
    cases = 0
    for seed, width in ((1, 24), (2, 64), (3, 128)):
        m, o = _model_opt(seed, width)
        p = _save(tmp_path / f"c{seed}", {"model": m, "optim": o})
        m2, o2 = _model_opt(seed + 100, width)  # the live run: other values
        f = p / ST
        size = f.stat().st_size
        rnd = random.Random(seed)
        for chunk in [c for c in range(0, size, CS) for _ in range(3)]:
            pos = rnd.randrange(chunk, min(chunk + CS, size))
            bit = rnd.randrange(8)
            before = _snapshot(m2, o2)
            flip(f, pos, bit)
            with pytest.raises((ChecksumMismatchError, FormatError)) as e:
                ckpt.load(p, {"model": m2, "optim": o2}, exactness="off")
            if isinstance(e.value, ChecksumMismatchError):
                assert e.value.context["chunk"] == pos // CS, str(e.value)
            _assert_same(before, m2, o2)
            flip(f, pos, bit)
            cases += 1
        ckpt.load(p, {"model": m2, "optim": o2}, exactness="off")  # intact again: loads
        assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    assert cases >= 50
    assert not shared or max(shares) > 2  # the hash and the copy were split into pieces


def test_every_mismatch_is_found_before_any_target_is_written(tmp_path: Path) -> None:
    m, o = _model_opt(1)
    small = torch.nn.Linear(3, 2)
    p = _save(tmp_path / "c", {"model": m, "optim": o, "small": small, "counters": {"n": 1}})
    m2, o2 = _model_opt(2)
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        # a later entry does not fit (before: the model was already overwritten)
        ({"model": m2, "optim": o2, "small": torch.nn.Linear(4, 2)}, {}),
        # a module with a key the checkpoint lacks
        ({"model": m2, "optim": o2, "small": torch.nn.Linear(3, 2, bias=False)}, {}),
        # a registered generator that was never saved (before: python/torch RNG already restored)
        ({"model": m2, "optim": o2}, {"generators": {"nope": torch.Generator()}}),
        # data-loader state asked for, none saved (before: checked after the tensors)
        ({"model": m2, "optim": o2}, {"data": _Data()}),
        # a plain tree whose shape does not take the saved one
        ({"model": m2, "optim": o2, "counters": [1, 2]}, {}),
    ]
    for state, kw in cases:
        before = _snapshot(m2, o2)
        with pytest.raises(StateMismatchError):
            ckpt.load(p, state, exactness="off", **kw)
        _assert_same(before, m2, o2)


class _Data:
    def __init__(self) -> None:
        self.state = {"epoch": 0}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.state = dict(sd)


def test_missing_tensor_file_changes_nothing(tmp_path: Path) -> None:
    m, o = _model_opt(1)
    p = _save(tmp_path / "c", {"model": m, "optim": o})
    m2, o2 = _model_opt(2)
    before = _snapshot(m2, o2)
    os.remove(p / ST)
    with pytest.raises(MissingFileError):
        ckpt.load(p, {"model": m2, "optim": o2}, exactness="off")
    _assert_same(before, m2, o2)


def test_rng_restore_that_fails_halfway_is_rolled_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m, _ = _model_opt(1)
    p = _save(tmp_path / "c", {"model": m})
    random.seed(99)
    torch.manual_seed(99)
    before = (random.getstate(), torch.get_rng_state())

    def refuse(state: Any) -> None:  # python was restored already, torch refuses
        raise RuntimeError("refused")

    monkeypatch.setattr(torch, "set_rng_state", refuse)
    with pytest.raises(StateMismatchError):
        ckpt.load(p, {"model": m}, exactness="off")
    monkeypatch.undo()
    assert random.getstate() == before[0] and torch.equal(torch.get_rng_state(), before[1])


def _change_between_passes(monkeypatch: pytest.MonkeyPatch, path: Path, pos: int) -> None:
    """Modify the tensor file in place after pass 1 verified it, as a faulty disk or a
    writer breaking the immutability rule would."""
    orig = CheckpointReader.stream_file_into  # pass 2 streams each tensor file with it

    def stream(self: CheckpointReader, pe: Any, index: int, dest: Any, **kw: Any) -> None:
        if os.path.dirname(self.path) == str(path.parent) and os.path.basename(self.path) == path.name:
            flip(path / ST, pos)
        return orig(self, pe, index, dest, **kw)

    monkeypatch.setattr(CheckpointReader, "stream_file_into", stream)


def _two_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The read-twice load (no leased mapping: another user's file, a filesystem without
    leases, an object store, a load off the main thread)."""
    import ckpt._load

    monkeypatch.setattr(ckpt._load, "_map_for_one_pass", lambda r, reader: False)


def test_a_file_changed_between_the_passes_is_detected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m, o = _model_opt(1)
    p = _save(tmp_path / "c", {"model": m, "optim": o})
    m2, o2 = _model_opt(2)
    _two_pass(monkeypatch)
    _change_between_passes(monkeypatch, p, (p / ST).stat().st_size - 3)
    with pytest.raises(CheckpointChangedError, match="changed after it was verified") as ei:
        ckpt.load(p, {"model": m2, "optim": o2}, exactness="off")
    assert isinstance(ei.value.__cause__, ChecksumMismatchError)


def test_resume_reloads_an_older_checkpoint_after_a_file_changed_between_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m, o = _model_opt(1)
    with override(chunk_size=CS):
        mgr = CheckpointManager(tmp_path, {"model": m, "optim": o}, signals=())
        mgr.save(1)
        older = [t.clone() for t in m.state_dict().values()]
        with torch.no_grad():
            for t in m.parameters():
                t.add_(1.0)
        mgr.save(2)
        mgr.close()
    m2, o2 = _model_opt(2)
    newest = tmp_path / "step-00000002"
    _two_pass(monkeypatch)
    _change_between_passes(monkeypatch, newest, (newest / ST).stat().st_size - 3)
    mgr = CheckpointManager(tmp_path, {"model": m2, "optim": o2}, signals=())
    with pytest.warns(ResumeFallbackWarning, match=r"step-00000002.*CheckpointChangedError"):
        res = mgr.resume(exactness="off")
    assert res.step == 1
    assert all(torch.equal(a, b) for a, b in zip(older, m2.state_dict().values()))
    mgr.close()


def _leases_here(tmp_path: Path) -> None:
    import fcntl

    from ckpt.storage import _lease

    probe = tmp_path / "lease-probe"
    probe.write_bytes(b"x")
    fd = os.open(probe, os.O_RDONLY)
    try:
        fcntl.fcntl(fd, _lease.F_SETLEASE, fcntl.F_RDLCK)
        fcntl.fcntl(fd, _lease.F_SETLEASE, fcntl.F_UNLCK)
    except OSError as e:
        pytest.skip(f"no read leases here ({e}): the in-place load reads twice instead of mapping")
    finally:
        os.close(fd)
        probe.unlink()


def test_a_one_pass_load_copies_the_bytes_it_verified_even_if_the_file_is_overwritten_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leased mapping (spec §11): opening the file for writing breaks the lease, the
    handler moves the verified bytes off the file before the writer may go on, and the
    copy reads those. The load returns what was verified; the file is changed after it."""
    from ckpt.storage import _lease

    _leases_here(tmp_path)
    m, o = _model_opt(1)
    p = _save(tmp_path / "c", {"model": m, "optim": o})
    m2, o2 = _model_opt(2)
    moved = len(_lease.migrations())
    _change_between_passes(monkeypatch, p, (p / ST).stat().st_size - 3)
    ckpt.load(p, {"model": m2, "optim": o2}, exactness="off")
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    assert _lease.migrations()[moved:] == (str(p / ST),)
    with pytest.raises(ChecksumMismatchError):
        ckpt.open(p).verify()


def test_a_one_pass_load_reads_no_tensor_byte_through_pread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resume in one pass (issue 27 item 3): the tensor file is hashed and copied from the
    leased mapping, not read twice (verify, then copy) through pread."""
    from ckpt.storage.posix import LocalFile

    _leases_here(tmp_path)
    m, o = _model_opt(1, width=256)
    p = _save(tmp_path / "c", {"model": m, "optim": o})
    read: list[int] = []
    real = LocalFile.pread_into

    def counting(self: LocalFile, offset: int, buf: memoryview) -> int:
        got = real(self, offset, buf)
        if self.path.endswith(ST):
            read.append(got)
        return got

    monkeypatch.setattr(LocalFile, "pread_into", counting)
    m2, o2 = _model_opt(2, width=256)
    ckpt.load(p, {"model": m2, "optim": o2}, exactness="off")
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    assert sum(read) < 4096, read  # the safetensors header at most; before: twice the file
    _two_pass(monkeypatch)
    read.clear()
    ckpt.load(p, {"model": m2, "optim": o2}, exactness="off")
    assert sum(read) >= 2 * (p / ST).stat().st_size - 8192


def test_a_lease_lost_before_the_copy_finished_is_a_changed_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel lets a writer through once the lease-break time passes (the main thread
    stuck in one C call that long): the copied bytes may then not be the verified ones."""
    from ckpt.storage import _lease

    _leases_here(tmp_path)
    m, o = _model_opt(1)
    p = _save(tmp_path / "c", {"model": m, "optim": o})
    m2, o2 = _model_opt(2)
    monkeypatch.setattr(_lease, "unchanged", lambda mapping: False)
    with pytest.raises(CheckpointChangedError, match="read lease was broken"):
        ckpt.load(p, {"model": m2, "optim": o2}, exactness="off")


# --- 2. a restore that does not take effect ------------------------------------------------------------


class CopyingWrapper(torch.nn.Module):
    """EMA/LoRA-style: ``state_dict()`` returns copies (here: merged, detached clones)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inner = torch.nn.Linear(6, 5)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {k: v.detach().clone() for k, v in self.inner.state_dict().items()}

    def load_state_dict(self, sd: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        return self.inner.load_state_dict(sd, strict=strict)


def test_a_module_whose_state_dict_returns_copies_is_restored_through_load_state_dict(tmp_path: Path) -> None:
    saved = CopyingWrapper(1)
    p = _save(tmp_path / "c", {"ema": saved})
    live = CopyingWrapper(2)
    assert not torch.equal(live.inner.weight, saved.inner.weight)
    ckpt.load(p, {"ema": live}, exactness="off")
    assert torch.equal(live.inner.weight, saved.inner.weight)
    assert torch.equal(live.inner.bias, saved.inner.bias)


def test_a_plain_module_is_still_restored_in_its_own_storage(tmp_path: Path) -> None:
    m, _ = _model_opt(1)
    p = _save(tmp_path / "c", {"model": m})
    m2, _ = _model_opt(2)
    ptrs = [t.data_ptr() for t in m2.parameters()]
    res = ckpt.load(p, {"model": m2}, exactness="off")
    assert res.in_place == len(m2.state_dict()) and res.fresh == 0
    assert [t.data_ptr() for t in m2.parameters()] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))


# --- 3. no silent conversion --------------------------------------------------------------------------------


def test_dtype_mismatch_is_an_error_naming_key_and_both_dtypes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m64 = torch.nn.Linear(3, 2).double()
    p = _save(tmp_path / "c", {"model": m64})
    m32 = torch.nn.Linear(3, 2)
    before = _snapshot(m32)
    with pytest.raises(StateMismatchError, match=r"float64\[2, 3\].*float32\[2, 3\].*cast=True") as ei:
        ckpt.load(p, {"model": m32}, exactness="off")
    assert ei.value.key == "model/weight"
    _assert_same(before, m32)
    # a plain tree too
    with pytest.raises(StateMismatchError, match="float64.*float32"):
        ckpt.load(p, {"model": {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}}, exactness="off")
    # opting in converts, in place
    ptr = m32.weight.data_ptr()
    ckpt.load(p, {"model": m32}, exactness="off", cast=True)
    assert m32.weight.data_ptr() == ptr and torch.equal(m32.weight, m64.weight.float())


def test_shape_mismatch_is_an_error_even_with_cast(tmp_path: Path) -> None:
    p = _save(tmp_path / "c", {"state": {"w": torch.ones(4, 3)}})
    with pytest.raises(StateMismatchError, match=r"float32\[4, 3\].*float32\[3, 4\]") as ei:
        ckpt.load(p, {"state": {"w": torch.zeros(3, 4)}}, exactness="off", cast=True)
    assert ei.value.key == "state/w"


# --- 4. verify accepts only what load can load ----------------------------------------------------------


def _craft_state(p: Path, edit: Any) -> None:
    """Rewrite the state document and re-sign it (digests, sizes, id), as a hostile user can."""
    f = manifest_of(p).parts[0].file("state")
    assert f is not None and f.name == SF
    raw = bytes(zstd_decompress((p / SF).read_bytes(), f.raw_size or 0))
    doc = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    edit(doc)
    raw = msgpack.packb(doc, use_bin_type=True)
    reseal(p, SF, zstd_compress(raw), raw_size=len(raw))


def _unknown_tensor_key(doc: dict[str, Any]) -> None:
    doc["state"]["model"]["weight"] = msgpack.ExtType(EXT_TENSOR, b"model/not-in-the-table")


def _bad_device(doc: dict[str, Any]) -> None:
    doc["state"]["meta"]["device"] = msgpack.ExtType(EXT_DEVICE, b"cuda:zero")


def _list_env(doc: dict[str, Any]) -> None:
    doc["context"]["env"] = ["python", "3.11"]


def _short_rng(doc: dict[str, Any]) -> None:
    doc["context"]["rng"]["python"]["state"] = [1, 2, 3]


CRAFTED = [("unknown tensor key", _unknown_tensor_key), ("bad device string", _bad_device),
           ("list-typed env", _list_env), ("truncated python RNG state", _short_rng)]


def _state_with_device(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(3, 2), "meta": {"device": torch.device("cpu"), "n": seed}}


@pytest.mark.parametrize("what, edit", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_verify_refuses_what_load_cannot_load(tmp_path: Path, what: str, edit: Any) -> None:
    p = _save(tmp_path / "c", _state_with_device(0))
    _craft_state(p, edit)
    with pytest.raises(FormatError) as ei:
        ckpt.open(p).verify()
    assert ei.value.path is not None and str(p) in ei.value.path
    with pytest.raises(FormatError):
        ckpt.open(p).verify(quick=True)
    live = _state_with_device(1)
    before = _snapshot(live["model"])
    with pytest.raises(FormatError):
        ckpt.load(p, live, exactness="off")
    _assert_same(before, live["model"])


def test_cli_verify_exits_nonzero_on_a_resigned_unloadable_checkpoint(tmp_path: Path) -> None:
    p = _save(tmp_path / "c", _state_with_device(0))
    ok = hangs.run([sys.executable, "-m", "ckpt_cli", "verify", str(p)], cwd=REPO, bound_s=hangs.hang_s(6))
    assert ok.returncode == 0, ok.stderr
    _craft_state(p, _unknown_tensor_key)
    res = hangs.run([sys.executable, "-m", "ckpt_cli", "verify", str(p)], cwd=REPO, bound_s=hangs.hang_s(6))
    assert res.returncode == 3, (res.stdout, res.stderr)
    assert "not-in-the-table" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("what, edit", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_resume_falls_back_past_a_resigned_checkpoint_and_names_it(tmp_path: Path, what: str, edit: Any) -> None:
    def state(seed: int) -> dict[str, Any]:
        s = _state_with_device(seed)
        return {"model": s["model"], "meta": s["meta"]}

    live = state(0)
    with override(chunk_size=CS):
        mgr = CheckpointManager(tmp_path, live, signals=())
        mgr.save(1)
        kept = live["model"].weight.detach().clone()
        with torch.no_grad():
            live["model"].weight.add_(1)
        mgr.save(2)
        mgr.close()
    _craft_state(tmp_path / "step-00000002", edit)
    other = state(5)
    mgr = CheckpointManager(tmp_path, other, signals=())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        res = mgr.resume(exactness="off")
    assert res is not None and res.step == 1
    assert torch.equal(other["model"].weight, kept)
    msgs = [str(w.message) for w in rec if issubclass(w.category, ResumeFallbackWarning)]
    assert len(msgs) == 1 and str(tmp_path / "step-00000002") in msgs[0] and "FormatError" in msgs[0], msgs
    mgr.close()


def test_resume_stops_at_a_checkpoint_whose_state_does_not_fit(tmp_path: Path) -> None:
    """The newest holds a float64 tensor the live float32 module cannot take: not damage,
    so no fallback (issue 22: falling back past a misfit restarts and overwrites the run)."""
    with override(chunk_size=CS):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2)
        mgr = CheckpointManager(tmp_path, {"model": m}, signals=())
        mgr.save(1)
        mgr.close()
        ckpt.save(tmp_path / "step-00000002", {"model": torch.nn.Linear(3, 2).double()}, step=2, code_dir=str(tmp_path))
    live = torch.nn.Linear(3, 2)
    mgr = CheckpointManager(tmp_path, {"model": live}, signals=())
    before = live.weight.detach().clone()
    with pytest.raises(ResumeMismatchError, match=r"step-00000002.*float64"):
        mgr.resume(exactness="off")
    assert torch.equal(live.weight, before) and mgr.start_step == 0
    mgr.close()


# --- packed tensors (format 2.0): a span that does not decode is found before any target is written ---


def _packed(tmp_path: Path) -> Path:
    m, o = _model_opt(1, width=256)
    with override(chunk_size=4096, bpz_block=4096):
        return _save(tmp_path / "c", {"model": m, "optim": o}, compress=lambda key, dtype, nbytes: dtype == "float32")


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("defect", ["bad-magic", "reserved-codec", "wrong-plane-length", "lying-zstd-frame"])
def test_a_resigned_span_that_does_not_decode_changes_no_target(tmp_path: Path, defect: str, verify: bool) -> None:
    """On 3930a40 ``load`` wrote the other tensors, then failed on the span and called it a
    file change (CheckpointChangedError), with verification on or off."""
    from tests.ckpt.test_verify_agrees_with_load import FIXED, _span_of, replace_span

    p = _packed(tmp_path)
    key = max((t for t in ckpt.open(p).tensor_entries() if t.encoding), key=lambda t: t.nbytes).key
    span, e, n = _span_of(p, key)
    replace_span(p, key, FIXED[defect](span, e, n))
    m2, o2 = _model_opt(2, width=256)
    before = _snapshot(m2, o2)
    with pytest.raises(FormatError, match="BPZ1 span") as ei:
        ckpt.load(p, {"model": m2, "optim": o2}, exactness="off", verify=verify)
    assert not isinstance(ei.value, CheckpointChangedError)
    assert ei.value.path.endswith(".bpz") and ei.value.key == key and ei.value.offset is not None
    _assert_same(before, m2, o2)
    with pytest.raises(FormatError, match="BPZ1 span"):
        ckpt.open(p).verify()


def test_a_packed_file_changed_between_the_passes_is_still_detected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one error pass 2 may still raise: the packed file modified in place after pass 1."""
    p = _packed(tmp_path)
    orig = CheckpointReader.stream_file_into
    flipped: list[str] = []

    def stream(self: CheckpointReader, pe: Any, index: int, dest: Any, **kw: Any) -> None:
        f = pe.files[index]
        if f.role == "packed" and not flipped:
            flipped.append(f.name)
            flip(p / f.name, f.size // 2)
        return orig(self, pe, index, dest, **kw)

    monkeypatch.setattr(CheckpointReader, "stream_file_into", stream)
    m2, o2 = _model_opt(2, width=256)
    with pytest.raises(CheckpointChangedError, match="changed after it was verified") as ei:
        ckpt.load(p, {"model": m2, "optim": o2}, exactness="off")
    assert flipped and isinstance(ei.value.__cause__, ChecksumMismatchError)
