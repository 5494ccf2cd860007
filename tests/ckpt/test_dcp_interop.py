"""DCP interop: import a checkpoint written by dcp.save (restricted unpickling of its
.metadata), export ours for dcp.load, round trips through the CLI (real subprocess)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import ckpt
from ckpt.dcp.interop import read_dcp_metadata
from ckpt.errors import FormatError
import hangs

REPO = Path(__file__).resolve().parents[2]


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    m(torch.randn(3, 5)).sum().backward()
    opt.step()
    return m, opt


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return hangs.run([sys.executable, "-m", "ckpt_cli", *args], cwd=REPO, capture_output=True, text=True, bound_s=hangs.hang_s(30))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_round_trip_through_our_format(tmp_path: Path) -> None:
    m, opt = _trained()
    msd, osd = get_state_dict(m, opt)
    src = tmp_path / "dcp-in"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(src), no_dist=True)

    r = _cli("import", "dcp", str(src), str(tmp_path / "ours"))
    assert r.returncode == 0, r.stderr
    ours = ckpt.open(tmp_path / "ours")
    assert ours.meta["imported_from"]["format"] == "dcp"
    full = ours.state()
    for k, v in msd.items():
        assert torch.equal(full["model"][k], v), k
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            assert torch.equal(full["optim"]["state"][fqn][k], v), (fqn, k)
    assert full["optim"]["param_groups"][0]["lr"] == 0.01

    # back out, and dcp.load with its default reader gets the same values
    r = _cli("export", "dcp", str(tmp_path / "ours"), str(tmp_path / "dcp-out"))
    assert r.returncode == 0, r.stderr
    m2, opt2 = _trained()
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    msd2, osd2 = get_state_dict(m2, opt2)
    sd = {"model": msd2, "optim": osd2}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp-out"), no_dist=True)
    for k, v in msd.items():
        assert torch.equal(sd["model"][k], v), k
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            assert torch.equal(sd["optim"]["state"][fqn][k], v), (fqn, k)


class _Evil:
    def __reduce__(self):  # would run a shell command under a plain unpickler
        return (os.system, ("echo pwned",))


@pytest.mark.slow
def test_restricted_unpickler_refuses_foreign_globals(tmp_path: Path) -> None:
    d = tmp_path / "evil"
    d.mkdir()
    (d / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(FormatError, match="does not allow"):
        read_dcp_metadata(d)
    r = _cli("import", "dcp", str(d), str(tmp_path / "x"))
    assert r.returncode == 3 and "does not allow" in r.stderr, (r.returncode, r.stderr)
    assert not (tmp_path / "x").exists()


def test_garbage_metadata_is_a_format_error(tmp_path: Path) -> None:
    d = tmp_path / "junk"
    d.mkdir()
    (d / ".metadata").write_bytes(b"\x80\x04not a pickle at all")
    with pytest.raises(FormatError):
        read_dcp_metadata(d)
    (d / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(FormatError, match="not Metadata"):
        read_dcp_metadata(d)
