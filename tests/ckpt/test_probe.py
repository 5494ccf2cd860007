"""``ckpt.probe.probe_path`` and what the reader raises for a path that is not a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.errors import CheckpointNotFoundError, FormatError, IncompleteCheckpointError, NotACheckpointError
from ckpt.probe import FOREIGN_KINDS, KINDS, probe_path


@pytest.fixture
def places(tmp_path: Path) -> dict[str, Path]:
    run = tmp_path / "run"
    ckpt.save(run / "step-00000001", {"w": torch.ones(3)}, step=1)
    ckpt.save(run / "step-00000012", {"w": torch.ones(3)}, step=12)
    (run / ".tmp-step-00000013-abcdef").mkdir()
    torn = run / "step-00000014"
    ckpt.save(torn, {"w": torch.ones(3)}, step=14)
    (torn / "MANIFEST").unlink()
    dcp_dir = tmp_path / "dcp"
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": torch.nn.Linear(2, 2).state_dict()}, checkpoint_id=str(dcp_dir), no_dist=True)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    from safetensors.torch import save_file

    save_file({"wte.weight": torch.ones(2, 2)}, str(hf / "model.safetensors"), metadata={"format": "pt"})
    trainer = tmp_path / "hf-trainer" / "checkpoint-5"
    trainer.mkdir(parents=True)
    (trainer / "trainer_state.json").write_text("{}")
    (trainer / "model.safetensors").write_bytes(b"")
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    (ledger / "00001.tape").write_bytes(b"CKPTTAPE" + bytes(64))
    tape = tmp_path / "run.tape"
    tape.write_bytes(b"CKPTTAPE" + bytes(64))
    script = tmp_path / "file.py"
    script.write_text("print('hi')\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("")
    return {"dir": tmp_path / "src", "checkpoint": run / "step-00000001", "run": run, "temporary": run / ".tmp-step-00000013-abcdef",
            "incomplete": torn, "dcp": dcp_dir, "hf": hf, "hf-trainer": trainer, "ledger": ledger, "tape": tape,
            "file": script, "missing": tmp_path / "nope", "empty": tmp_path / "empty"}


pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_every_kind_is_recognised(places: dict[str, Path]) -> None:
    for name, p in places.items():
        want = "incomplete" if name == "empty" else name
        got = probe_path(p)
        assert got.kind == want, (name, got)
        assert got.kind in KINDS and got.what
    run = probe_path(places["run"])
    assert run.checkpoints == ("step-00000001", "step-00000012")  # committed only, oldest step first
    assert "newest step-00000012" in run.what and "ckpt ls" in run.hint
    assert "ckpt import dcp" in probe_path(places["dcp"]).hint
    assert "ckpt tape show" in probe_path(places["tape"]).hint
    assert "from_pretrained" in probe_path(places["hf"]).hint


def test_reader_names_what_a_path_is(places: dict[str, Path]) -> None:
    for name in FOREIGN_KINDS:
        with pytest.raises(NotACheckpointError) as ei:
            ckpt.open(places[name])
        e = ei.value
        assert e.kind == name and e.exit_code == 7 and str(places[name]) in str(e)
        assert isinstance(e, FormatError)  # callers that caught FormatError for a file keep working
    with pytest.raises(NotACheckpointError, match=r"a DCP checkpoint.*ckpt import dcp"):
        ckpt.open(places["dcp"])
    with pytest.raises(NotACheckpointError, match=r"a run directory \(2 checkpoint\(s\), newest step-00000012\)"):
        ckpt.open(places["run"])
    with pytest.raises(IncompleteCheckpointError, match="no MANIFEST: the save never committed"):
        ckpt.open(places["incomplete"])
    with pytest.raises(IncompleteCheckpointError, match="empty directory"):
        ckpt.open(places["empty"])
    with pytest.raises(IncompleteCheckpointError, match="temporary"):
        ckpt.open(places["temporary"])
    with pytest.raises(CheckpointNotFoundError):
        ckpt.open(places["missing"])


def test_the_same_answers_through_a_storage_backend(places: dict[str, Path]) -> None:
    """What an object-store backend is asked (lstat, listdir, read): the same kinds."""
    from ckpt.storage import local

    class Backend:  # a backend of another scheme, served here by the local one
        scheme = "test"

        def lstat(self, p: str):
            return local.lstat(p)

        def listdir(self, p: str):
            return local.listdir(p)

        def read(self, p: str, offset: int, size: int) -> bytes:
            return local.read(p, offset, size)

    for name, p in places.items():
        assert probe_path(p, storage=Backend()).kind == probe_path(p).kind, name
