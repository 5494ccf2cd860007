"""Writer and reader agree on REPLICA chains (issue 22 item 8): the writer refuses what
the reader refuses (more than 4 hops, a cycle, a missing part or entry), a chain within
the limit loads, and ``ckpt inspect`` names the part that holds the data, not the next hop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckpt
from ckpt.errors import FormatError
from ckpt.writer import Replicated
from ckpt_cli.main import cli

W = {"w": torch.arange(4.0)}


def _commit(path: Path, chain: dict[str, str | None]) -> None:
    """chain: part -> the part it is a REPLICA of (None: holds the data)."""
    pending = ckpt.begin(path)
    parts = [ckpt.write_part(pending, name, {"model": W if src is None else Replicated(src)}, step=1)
             for name, src in chain.items()]
    ckpt.commit(pending, parts)


def _hops(n: int) -> dict[str, str | None]:
    """rank-00000 holds the data; rank-0000k is a REPLICA of rank-0000(k-1): n hops from the last."""
    return {f"rank-{k:05d}": (None if k == 0 else f"rank-{k - 1:05d}") for k in range(n + 1)}


def test_a_four_hop_chain_commits_loads_and_inspect_names_the_holder(tmp_path: Path) -> None:
    _commit(tmp_path / "c", _hops(4))
    r = ckpt.open(tmp_path / "c")
    assert torch.equal(r.state("model", part="rank-00004")["w"], W["w"])
    rep = json.loads(CliRunner().invoke(cli, ["inspect", "--json", str(tmp_path / "c")]).stdout)
    entry = {p["name"]: p["entries"]["model"] for p in rep["parts"]}["rank-00004"]
    assert entry["replica"]["part"] == "rank-00000" and entry["replica"]["tensors"] == 1  # not rank-00003


def test_a_five_hop_chain_is_refused_at_commit(tmp_path: Path) -> None:
    """It used to commit, and its own reader refused it ("replica references form a chain")."""
    with pytest.raises(FormatError, match="REPLICA chain of more than 4 hops"):
        _commit(tmp_path / "c", _hops(5))
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("chain, msg", [
    ({"rank-00000": "rank-00001", "rank-00001": "rank-00000"}, "more than 4 hops \\(or a cycle\\)"),
    ({"rank-00000": None, "rank-00001": "rank-00009"}, "which this commit does not hold"),
])
def test_a_broken_chain_is_refused_at_commit(tmp_path: Path, chain: dict[str, str | None], msg: str) -> None:
    with pytest.raises(FormatError, match=msg):
        _commit(tmp_path / "c", chain)
