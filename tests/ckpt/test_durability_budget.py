"""The fixed cost of one checkpoint: files, fsyncs and directory fsyncs, in order.

spec/checkpoint-format.md §10.7 lists every fsync a save makes and what it protects;
this pins both the count and the order that makes them sufficient: each file is
fsynced before MANIFEST exists (or, in the fused commit of a small ``ckpt.save``, with
it, recovery then re-hashing such a copy), MANIFEST and the temporary directory before
the publishing rename, and the parent after it. A crash (power loss, not just
SIGKILL) at any point then leaves either no trace under the final name or a complete,
durable checkpoint. Operations the durability rules do not need (a directory fsync
after removing a replaced copy or a retention victim) must not come back.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
import ckpt.storage.commit
from ckpt.manager import CheckpointManager, RetentionPolicy
from ckpt.storage import LocalStorage


class Log:
    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.events: list[tuple[str, str]] = []

    def rel(self, p: str) -> str:
        p = os.fspath(p)
        rel = os.path.relpath(p, self.root)
        parts = rel.split(os.sep)
        # temporary names carry random hex: keep only their kind
        return "/".join("<tmp>" if s.startswith(".tmp-") and not s.endswith((".old", ".del")) else
                        "<old>" if s.endswith(".old") else "<del>" if s.endswith(".del") else s for s in parts)

    def add(self, what: str, path: str) -> None:
        self.events.append((what, self.rel(path)))

    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k, _ in self.events:
            out[k] = out.get(k, 0) + 1
        return out


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Log:
    lg = Log(tmp_path)
    real_open, real_fsync = os.open, os.fsync

    def logged_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
        fd = real_open(path, flags, *a, **k)
        if flags & os.O_CREAT:
            lg.add("create", os.fspath(path))
        return fd

    def logged_fsync(fd: int) -> None:
        st = os.fstat(fd)
        lg.add("fsync-dir" if stat.S_ISDIR(st.st_mode) else "fsync", os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "open", logged_open)
    monkeypatch.setattr(os, "fsync", logged_fsync)
    for name in ("rename_noreplace", "exchange", "rename_dir"):
        real = getattr(LocalStorage, name)

        def wrapped(self: Any, a: str, b: str, _real: Any = real, _name: str = name) -> Any:
            out = _real(self, a, b)
            if out is not False:  # exchange returns False where unsupported: nothing happened
                lg.events.append((_name, f"{lg.rel(a)} -> {lg.rel(b)}"))
            return out

        monkeypatch.setattr(LocalStorage, name, wrapped)
    real_rm = LocalStorage.remove_tree
    monkeypatch.setattr(LocalStorage, "remove_tree", lambda self, p: (lg.add("remove", p), real_rm(self, p))[1])
    return lg


def _state() -> dict[str, Any]:
    return {"w": torch.arange(6, dtype=torch.float32), "opt": {"lr": 0.1, "m": torch.ones(3)}}


DATA = ("<tmp>/rank-00000.safetensors", "<tmp>/rank-00000.state.msgpack.zst")


def _check_commit_order(ev: list[tuple[str, str]], prefix: str = "", *, fused: bool = False) -> int:
    """The rules of §10.7 on one save's events; returns the index of the publishing step.

    Waits with no order between them run together (the tensor file's fsync while the
    state file is written; MANIFEST's fsync beside the directory's; in a fused commit all
    of them), so the exact interleaving varies; what must hold is this partial order.
    Strict: every data file fsynced before MANIFEST exists. Fused (a small ``ckpt.save``):
    MANIFEST created once the data files are written, and every fsync issued after it,
    all done before the rename.
    """
    def at(event: tuple[str, str]) -> int:
        assert ev.count(event) == 1, (event, ev)
        return ev.index(event)

    manifest = at(("create", prefix + "<tmp>/MANIFEST"))
    publish = next(i for i, (k, _) in enumerate(ev) if k in ("rename_noreplace", "exchange", "rename_dir"))
    for f in DATA:
        if fused:
            assert at(("create", prefix + f)) < manifest < at(("fsync", prefix + f)) < publish, (f, ev)
        else:
            assert at(("create", prefix + f)) < at(("fsync", prefix + f)) < manifest, (f, ev)
    assert manifest < at(("fsync", prefix + "<tmp>/MANIFEST")) < publish
    assert manifest < at(("fsync-dir", prefix + "<tmp>")) < publish
    return publish


def test_a_new_save_makes_three_files_three_fsyncs_and_two_directory_fsyncs_in_order(tmp_path: Path, log: Log) -> None:
    ckpt.save(tmp_path / "c", _state(), step=1)
    publish = _check_commit_order(log.events, fused=True)
    assert log.events[publish:] == [("rename_noreplace", "<tmp> -> c"), ("fsync-dir", ".")]
    assert log.kinds() == {"create": 3, "fsync": 3, "fsync-dir": 2, "rename_noreplace": 1}


@pytest.mark.parametrize("limit", [0, 100], ids=["tensors-above", "files-above"])
def test_a_save_above_the_fused_limit_makes_its_files_durable_before_the_manifest(
    tmp_path: Path, log: Log, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    """Recovery re-hashes only copies up to FUSED_COMMIT_MAX (§10.3), so a larger save
    keeps the strict order, whether its tensors (36 bytes here) or only its files (the
    structure, the header: > 100 bytes) pass the limit."""
    monkeypatch.setattr(ckpt.storage.commit, "FUSED_COMMIT_MAX", limit)
    ckpt.save(tmp_path / "c", _state(), step=1)
    publish = _check_commit_order(log.events)
    assert log.events[publish:] == [("rename_noreplace", "<tmp> -> c"), ("fsync-dir", ".")]
    assert log.kinds() == {"create": 3, "fsync": 3, "fsync-dir": 2, "rename_noreplace": 1}


@pytest.mark.parametrize("rename2", [True, False], ids=["exchange", "fallback"])
def test_an_overwrite_fsyncs_the_parent_once_and_not_after_removing_the_old_copy(tmp_path: Path, log: Log, rename2: bool) -> None:
    ckpt.save(tmp_path / "c", _state(), step=1)
    log.events.clear()
    ckpt.save(tmp_path / "c", _state(), step=2, overwrite=True, storage=LocalStorage(renameat2=rename2))
    ev = log.events
    tail = ev[_check_commit_order(ev, fused=True):]
    if rename2:
        assert tail == [("exchange", "<tmp> -> c"), ("fsync-dir", "."), ("remove", "<tmp>")]
    else:
        assert tail == [("rename_dir", "c -> <old>"), ("rename_noreplace", "<tmp> -> c"), ("fsync-dir", "."), ("remove", "<old>")]
    assert log.kinds()["fsync-dir"] == 2
    assert ckpt.open(tmp_path / "c").step == 2


def test_a_manager_save_with_retention_costs_what_a_plain_save_costs(tmp_path: Path, log: Log) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    mgr = CheckpointManager(tmp_path / "run", {"model": model, "optim": opt}, retention=RetentionPolicy(keep_last=1), signals=())
    try:
        mgr.save(1)
        log.events.clear()
        mgr.save(2)  # commits step 2, then retention deletes step 1
        kinds = log.kinds()
    finally:
        mgr.close()  # (closing fsyncs the ledger tape once per run, not per save)
    assert kinds["create"] == 3 and kinds["fsync"] == 3 and kinds["fsync-dir"] == 2, "\n".join(map(str, log.events))
    _check_commit_order(log.events, "run/")
    # the deletion: renamed aside first (a crash never leaves a torn step-*), then removed
    assert [e for e in log.events if e[0] in ("rename_dir", "remove") and "ledger" not in e[1]] == [
        ("rename_dir", "run/step-00000001 -> run/<del>"),
        ("remove", "run/<del>"),
    ]
    assert sorted(n for n in os.listdir(tmp_path / "run") if n.startswith("step-")) == ["step-00000002"]


def test_every_data_file_is_durable_before_the_manifest_exists_for_many_parts(tmp_path: Path, log: Log) -> None:
    pending = ckpt.begin(tmp_path / "multi")
    parts = [ckpt.write_part(pending, f"rank-{r:05d}", {"x": torch.full((4,), float(r))}, step=3) for r in range(3)]
    ckpt.commit(pending, parts, step=3)
    ev = log.events
    manifest_at = ev.index(("create", "<tmp>/MANIFEST"))
    created = [p for k, p in ev[:manifest_at] if k == "create"]
    synced = {p for k, p in ev[:manifest_at] if k == "fsync"}
    assert len(created) == 6 and set(created) == synced
    assert log.kinds()["fsync-dir"] == 2


def test_a_rewind_makes_its_deletions_durable_before_removing_anything(tmp_path: Path, log: Log) -> None:
    """A rewind deletes the checkpoints newer than the one it loads: one a crash brought
    back would be the next resume's pick, so the renames aside are fsynced (once)."""
    model = torch.nn.Linear(4, 4)
    mgr = CheckpointManager(tmp_path / "run", {"model": model}, retention=RetentionPolicy(keep_last=5), signals=())
    try:
        for step in (1, 2, 3):
            mgr.save(step)
        log.events.clear()
        rw = mgr.rewind(step=1)
        ev = [e for e in log.events if "ledger" not in e[1]]
    finally:
        mgr.close()
    assert rw is not None and sorted(rw.discarded) == ["step-00000002", "step-00000003"]
    kinds = [k for k, _ in ev]
    assert kinds == ["rename_dir", "rename_dir", "fsync-dir", "remove", "remove"], ev
    assert ev[2] == ("fsync-dir", "run")
    assert sorted(n for n in os.listdir(tmp_path / "run") if n.startswith("step-")) == ["step-00000001"]
