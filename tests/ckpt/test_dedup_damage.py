"""A shared file damaged in place (format 2.0 dedup, spec/format-2.md §V.4.6; issue 22 item 2).

One byte flipped in a file hard-linked into every checkpoint of a run (a media fault,
``rsync --inplace``) damages the checkpoints that hold it. A later dedup save must not link it
into the next checkpoint too: it checks what it links (size, inode and mtime against its
record, a window of chunk digests re-hashed on a budget), writes the tensors again from memory
when the bytes differ, and says so (``SharedFileDamagedWarning`` naming the file). Retention
then keeps the checkpoints that load, and a restarted job resumes from the newest, exactly.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
from ckpt import CheckpointManager, RetentionPolicy
from ckpt import _linkcheck
from ckpt.errors import ChecksumMismatchError
from ckpt.knobs import override
from ckpt.manager import SharedFileDamagedWarning, plan_retention, CheckpointRecord


def _flip_in_place(path: Path, offset: int, *, keep_mtime: bool = True) -> None:
    """Flip one bit at ``offset`` (from the end when negative) through the file's own inode,
    keeping its size and, adversarially, its mtime (``os.utime``): what ``rsync --inplace -t``
    or a medium fault seen through the page cache leaves behind."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_ino) == (st.st_size, st.st_ino)
    assert (after.st_mtime_ns == st.st_mtime_ns) == keep_mtime


def _shared(path: Path) -> Any:
    return next(f for f in ckpt.open(path).manifest.files if f.origin is not None)


def _inodes(path: Path) -> set[int]:
    return {os.stat(path / n).st_ino for n in os.listdir(path)}


def _state(step: int, base: torch.Tensor) -> dict[str, Any]:
    return {"base": {"w": base}, "head": {"w": torch.full((16,), float(step))}}


def test_a_flipped_byte_under_a_restored_mtime_is_written_again_not_linked(tmp_path: Path) -> None:
    base = torch.randn(60000)
    ckpt.save(tmp_path / "s1", _state(1, base), dedup=True)
    ckpt.save(tmp_path / "s2", _state(2, base), dedup_from=tmp_path / "s1")
    shared = _shared(tmp_path / "s2")
    _flip_in_place(tmp_path / "s2" / shared.name, -7)  # s1 and s2 both hold these bytes
    with pytest.warns(SharedFileDamagedWarning, match=re.escape(shared.name)) as got:
        info = ckpt.save(tmp_path / "s3", _state(3, base), dedup_from=tmp_path / "s2")
    assert "does not match its digest" in str(got[0].message)
    r = ckpt.open(tmp_path / "s3")
    r.verify()  # the new checkpoint is whole
    assert not any(f.origin for f in info.manifest.files)
    assert os.stat(tmp_path / "s2" / shared.name).st_ino not in _inodes(tmp_path / "s3")
    assert sorted(os.listdir(tmp_path / "s3")) == sorted(["MANIFEST", *(f.name for f in info.manifest.files)])
    loaded = r.state()
    assert torch.equal(loaded["base"]["w"], base) and torch.equal(loaded["head"]["w"], torch.full((16,), 3.0))
    # what already held the damaged bytes fails, as spec §V.4.3 says; nothing newer does
    for name in ("s1", "s2"):
        with pytest.raises(ChecksumMismatchError):
            ckpt.open(tmp_path / name).verify()
    # and dedup goes on from the fresh bytes: the next save shares them
    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedFileDamagedWarning)
        nxt = ckpt.save(tmp_path / "s4", _state(4, base), dedup_from=tmp_path / "s3")
    assert [f.origin for f in nxt.manifest.files if f.origin] == ["s3"]
    ckpt.open(tmp_path / "s4").verify()


def test_a_restarted_process_rehashes_in_full_what_it_links_first(tmp_path: Path) -> None:
    base = torch.randn(60000)
    with override(dedup_rehash_every=1000, chunk_size=4096):  # a window of one chunk per save
        ckpt.save(tmp_path / "s1", _state(1, base), dedup=True)
        _flip_in_place(tmp_path / "s1" / _shared_name(tmp_path / "s1"), -3)
        _linkcheck.forget()  # a new process: no record of what was written or checked
        with pytest.warns(SharedFileDamagedWarning, match="chunk"):
            ckpt.save(tmp_path / "s2", _state(2, base), dedup_from=tmp_path / "s1")
    ckpt.open(tmp_path / "s2").verify()


def _shared_name(path: Path) -> str:
    return next(f.name for f in ckpt.open(path).manifest.files if f.role == "tensors")


def test_the_window_finds_a_stat_invisible_change_within_k_saves_and_a_stat_change_at_once(tmp_path: Path) -> None:
    """With ``dedup_rehash_every=K`` a file whose size, inode and mtime are unchanged has a
    window of ceil(chunks / K) chunks re-hashed per save, so every chunk within K saves (the
    documented exposure: the saves before it hold the damaged bytes); a change of mtime is a
    full re-hash at the next save."""
    base = torch.randn(60000)  # 240 KB: 59 chunks of 4 KiB
    k = 4
    with override(dedup_rehash_every=k, chunk_size=4096):
        for where in range(0, 240_000, 40_000):  # every part of the file, one run each
            run = tmp_path / f"run-{where}"
            prev = run / "s0"
            ckpt.save(prev, _state(0, base), dedup=True)
            _flip_in_place(prev / _shared_name(prev), 200 + where)
            found = None
            for i in range(1, k + 1):
                cur = run / f"s{i}"
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always", SharedFileDamagedWarning)
                    ckpt.save(cur, _state(i, base), dedup_from=prev)
                if any(issubclass(w.category, SharedFileDamagedWarning) for w in seen):
                    found = i
                    break
                prev = cur
            assert found is not None, f"a flip at byte {200 + where} went unseen for {k} saves"
            ckpt.open(run / f"s{found}").verify()
        # the same flip with the mtime changed (no utime): found by the next save, in full
        run = tmp_path / "run-mtime"
        ckpt.save(run / "s0", _state(0, base), dedup=True)
        ckpt.save(run / "s1", _state(1, base), dedup_from=run / "s0")
        _flip_in_place(run / "s1" / _shared(run / "s1").name, 230_000, keep_mtime=False)
        os.utime(run / "s1" / _shared(run / "s1").name, ns=(1, 1))  # a different mtime, even on a coarse clock
        with pytest.warns(SharedFileDamagedWarning):
            ckpt.save(run / "s2", _state(2, base), dedup_from=run / "s1")
        ckpt.open(run / "s2").verify()


def test_a_truncated_shared_file_is_reported_and_written(tmp_path: Path) -> None:
    base = torch.randn(60000)
    ckpt.save(tmp_path / "s1", _state(1, base), dedup=True)
    victim = tmp_path / "s1" / _shared_name(tmp_path / "s1")
    os.truncate(victim, victim.stat().st_size - 4)
    with pytest.warns(SharedFileDamagedWarning, match=re.escape(victim.name)):
        ckpt.save(tmp_path / "s2", _state(2, base), dedup_from=tmp_path / "s1")
    ckpt.open(tmp_path / "s2").verify()


# --- the manager: retention and a restart ------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(2000, 64), torch.nn.Linear(64, 8))
    m[0].weight.requires_grad_(False)  # frozen: the file every checkpoint shares
    return m


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randint(0, 2000, (8,))  # draws from the global generator: its state is saved too
    loss = m(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _snapshot(m: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any], torch.Tensor]:
    osd = opt.state_dict()
    flat = {f"{i}.{k}": v.clone() for i, s in osd["state"].items() for k, v in s.items() if torch.is_tensor(v)}
    return {k: v.clone() for k, v in m.state_dict().items()}, flat, torch.get_rng_state()


def test_a_run_with_a_damaged_shared_file_keeps_what_loads_and_resumes_exactly(tmp_path: Path) -> None:
    m = _model()
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    mgr = CheckpointManager(tmp_path, {"model": m, "optim": opt}, dedup=True, retention=RetentionPolicy(keep_last=2),
                            signals=(), ledger=False)
    for step in range(1, 5):
        _train(m, opt)
        mgr.save(step)
    assert [r.name for r in mgr.checkpoints()] == ["step-00000003", "step-00000004"]
    shared = _shared(tmp_path / "step-00000004")
    assert shared.origin == "step-00000001"  # written once, linked into every checkpoint since
    _flip_in_place(tmp_path / "step-00000004" / shared.name, -11)
    _train(m, opt)
    want = _snapshot(m, opt)
    with pytest.warns(SharedFileDamagedWarning, match=re.escape(shared.name)):
        mgr.save(5)
    # Retention: the damaged checkpoints do not count toward keep_last; the one that loads stays.
    assert [r.name for r in mgr.checkpoints()] == ["step-00000005"]
    ckpt.open(tmp_path / "step-00000005").verify()
    mgr.close()

    # A restarted job (no records of this process) resumes from step 5, exactly.
    _linkcheck.forget()
    torch.manual_seed(1234)
    m2 = torch.nn.Sequential(torch.nn.Embedding(2000, 64), torch.nn.Linear(64, 8))
    m2[0].weight.requires_grad_(False)
    opt2 = torch.optim.Adam([p for p in m2.parameters() if p.requires_grad], lr=1e-2)
    mgr2 = CheckpointManager(tmp_path, {"model": m2, "optim": opt2}, dedup=True, retention=RetentionPolicy(keep_last=2),
                             signals=(), ledger=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback past a damaged checkpoint: the newest loads
        res = mgr2.resume(exactness="off")
    assert res is not None and res.step == 5
    got = _snapshot(m2, opt2)
    assert set(got[0]) == set(want[0]) and all(torch.equal(got[0][k], want[0][k]) for k in want[0])
    assert set(got[1]) == set(want[1]) and all(torch.equal(got[1][k], want[1][k]) for k in want[1])
    assert torch.equal(got[2], want[2])
    # and the next save of the restarted job shares the fresh bytes again, and both verify
    _train(m2, opt2)
    mgr2.save(6)
    mgr2.close()
    assert [r.name for r in list_names(tmp_path)] == ["step-00000005", "step-00000006"]
    assert {f.origin for f in ckpt.open(tmp_path / "step-00000006").manifest.files if f.origin} == {"step-00000005"}
    for name in ("step-00000005", "step-00000006"):
        ckpt.open(tmp_path / name).verify()


def list_names(run: Path) -> list[CheckpointRecord]:
    return ckpt.list_checkpoints(run)


def test_retention_does_not_count_damaged_checkpoints_toward_keep_last() -> None:
    recs = [CheckpointRecord(f"step-{s:08d}", f"/r/step-{s:08d}", s, True) for s in range(1, 7)]
    plain = plan_retention(recs, RetentionPolicy(keep_last=2))
    assert sorted(plain) == ["step-00000005", "step-00000006"]
    # 4 and 5 hold a damaged file: the two newest that load are 6 and 3; 4 and 5 are newer than 3
    keep = plan_retention(recs, RetentionPolicy(keep_last=2), damaged={"step-00000004", "step-00000005"})
    assert sorted(keep) == ["step-00000003", "step-00000004", "step-00000005", "step-00000006"]
    assert keep["step-00000003"] == ("last",) and keep["step-00000004"] == ("damaged",)
    # all damaged: as without the knowledge (the newest always stays)
    names = {r.name for r in recs}
    assert plan_retention(recs, RetentionPolicy(keep_last=2), damaged=names) == plain


def test_an_object_store_copy_of_a_replaced_object_is_checked_by_etag(s3: Any) -> None:
    """On S3 a shared file is a server-side copy (§V.4.5): an object replaced since it was
    written (a new ETag) is re-hashed, found damaged, and written again; the older copies are
    objects of their own and still load, so retention keeps them."""
    state = {"base": {"w": torch.randn(30000)}, "head": {"w": torch.zeros(8)}}
    storage = s3.storage()
    if not callable(getattr(storage, "link", None)):
        pytest.skip("this backend has no server-side copy")
    mgr = CheckpointManager(s3.url("run"), state, dedup=True, retention=RetentionPolicy(keep_last=2), signals=(),
                            ledger=False)
    mgr.save(1)
    state["head"]["w"] += 1
    mgr.save(2)
    r2 = ckpt.open(s3.url("run/step-00000002"))
    shared = next(f for f in r2.manifest.files if f.origin)
    url = s3.url(f"run/step-00000002/{shared.name}")
    data = bytearray(storage.read(url, 0, shared.size))
    data[-9] ^= 0x10
    storage.put(url, bytes(data))  # same size, new ETag
    state["head"]["w"] += 1
    with pytest.warns(SharedFileDamagedWarning, match=re.escape(shared.name)):
        mgr.save(3)
    mgr.close()
    r3 = ckpt.open(s3.url("run/step-00000003"))
    r3.verify()
    got = r3.state()
    assert torch.equal(got["base"]["w"], state["base"]["w"]) and torch.equal(got["head"]["w"], state["head"]["w"])
    # step 1's own copy is intact: it counts toward keep_last, and the damaged step 2 (newer) stays
    names = [r.name for r in ckpt.list_checkpoints(s3.url("run"))]
    assert names == ["step-00000001", "step-00000002", "step-00000003"]
    ckpt.open(s3.url("run/step-00000001")).verify()
    with pytest.raises(ChecksumMismatchError):
        r2.verify()
