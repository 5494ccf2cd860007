"""``import_dcp`` on a ``.metadata`` that lies: chunks that leave a gap or overlap, sizes
the data files cannot hold, fields of the wrong type. Each is a FormatError naming the
tensor, raised before anything is allocated or written (issue 22 items 4 and 9)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

import ckpt
from ckpt.convert.dcp import import_dcp
from ckpt.errors import FormatError, LimitExceededError

from tests.ckpt._dcp_kit import rows, write_dcp
import hangs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

W = torch.arange(48, dtype=torch.float32).reshape(8, 6)


def test_row_sharded_tensor_imports_exactly(tmp_path: Path) -> None:
    src = write_dcp(tmp_path / "src", {"w": ((8, 6), rows(W, 3, 5)), "s": ((), [((), torch.tensor(7))])},
                    values={"lr": 0.5})
    import_dcp(src, tmp_path / "out")
    st = ckpt.open(tmp_path / "out").state()
    assert torch.equal(st["w"], W) and torch.equal(st["s"], torch.tensor(7)) and st["lr"] == 0.5


def test_a_gap_in_the_chunks_is_refused_by_name_and_offsets(tmp_path: Path) -> None:
    chunks = rows(W, 3, 5)
    del chunks[1]  # rows 3..5 held by no chunk: torch.empty's bytes would be imported there
    src = write_dcp(tmp_path / "src", {"w": ((8, 6), chunks)})
    with pytest.raises(FormatError, match=r"no chunk of 'w' covers offsets \[3, 0\] \(extent \[2, 6\]\)") as ei:
        import_dcp(src, tmp_path / "out")
    assert ei.value.key == "w" and ei.value.path.endswith(".metadata")
    assert not (tmp_path / "out").exists()


def test_a_gap_in_a_second_dimension_is_found(tmp_path: Path) -> None:
    chunks = [((0, 0), W[:, :4]), ((0, 4), W[:4, 4:])]  # rows 4..8 of columns 4..6 left out
    src = write_dcp(tmp_path / "src", {"w": ((8, 6), chunks)})
    with pytest.raises(FormatError, match=r"covers offsets \[4, 4\] \(extent \[4, 2\]\)"):
        import_dcp(src, tmp_path / "out")


def test_overlapping_chunks_are_refused_by_name(tmp_path: Path) -> None:
    chunks = [((0, 0), W[:5]), ((3, 0), W[3:])]  # rows 3..5 held twice
    src = write_dcp(tmp_path / "src", {"w": ((8, 6), chunks)})
    with pytest.raises(FormatError, match=r"chunks \[0, 0\] and \[3, 0\] of 'w' overlap at offsets \[3, 0\]"):
        import_dcp(src, tmp_path / "out")


def test_items_sharing_bytes_are_refused(tmp_path: Path) -> None:
    def alias(md: Any) -> None:  # the second value points at the first one's bytes
        keys = list(md.storage_data)
        md.storage_data[keys[1]] = md.storage_data[keys[0]]

    src = write_dcp(tmp_path / "src", {}, values={"a": 1, "b": 2}, mutate=alias)
    with pytest.raises(FormatError, match="share bytes of __0_0.distcp"):
        import_dcp(src, tmp_path / "out")


def test_a_small_metadata_cannot_declare_a_huge_tensor(tmp_path: Path) -> None:
    """1 KiB of .metadata declaring 2^28 float32 elements (1 GiB) over a 1.5 KiB item."""
    def inflate(md: Any) -> None:
        sm = md.state_dict_metadata["w"]
        sm.size = torch.Size([1 << 28])
        sm.chunks[0].sizes = torch.Size([1 << 28])

    src = write_dcp(tmp_path / "src", {"w": ((4,), [((0,), torch.zeros(4))])}, mutate=inflate)
    assert (src / ".metadata").stat().st_size < 1024
    with pytest.raises(FormatError, match=r"chunk \[0\] of 'w' declares 1073741824 bytes of elements; its item holds"):
        import_dcp(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_chunk_of_another_dtype_is_refused(tmp_path: Path) -> None:
    def relabel(md: Any) -> None:
        md.state_dict_metadata["w"].properties.dtype = torch.int32  # the stored chunk is float32

    src = write_dcp(tmp_path / "src", {"w": ((8, 6), rows(W, 4))}, mutate=relabel)
    with pytest.raises(FormatError, match=r"chunk \[0, 0\] of 'w' is a torch.float32 tensor of shape \[4, 6\], not torch.int32"):
        import_dcp(src, tmp_path / "out")


def _size(v: Any) -> Any:
    def f(md: Any) -> None:
        md.state_dict_metadata["w"].size = v
        md.state_dict_metadata["w"].chunks[0].sizes = v
        md.state_dict_metadata["w"].chunks[0].offsets = [0] * len(v)
        (key,) = [k for k in md.storage_data if k.fqn == "w"]
        md.storage_data[MetadataIndex("w", [0] * len(v))] = md.storage_data.pop(key)
    return f


def _set_attr(obj: str, attr: str, v: Any) -> Any:
    def f(md: Any) -> None:
        target = md if obj == "md" else md.state_dict_metadata["w"] if obj == "w" else md.state_dict_metadata["w"].properties
        setattr(target, attr, v)
    return f


# the 9 cases that raised tracebacks on 3930a40 (issue 22 item 9), and their neighbours
BAD = {
    "negative size": (_size([-4]), FormatError, "negative"),
    "2^40 size": (_size([1 << 40]), FormatError, "declares 4398046511104 bytes"),
    "non-dtype dtype": (_set_attr("props", "dtype", "float32"), FormatError, "not a torch.dtype"),
    "list for state_dict_metadata": (lambda md: setattr(md, "state_dict_metadata", [1, 2]), FormatError, "not a dict"),
    "list for storage_data": (lambda md: setattr(md, "storage_data", list(md.storage_data.values())), FormatError, "not a dict"),
    "list for planner_data": (lambda md: setattr(md, "planner_data", [("w",)]), FormatError, "not a dict"),
    "dict for chunks": (_set_attr("w", "chunks", {}), FormatError, "not a list"),
    "64-dim overflow": (_size([1 << 40] * 64), FormatError, "declares"),
    "65 dims": (_size([1] * 65), LimitExceededError, "65 dimensions"),
    "float size": (_size([4.0]), FormatError, "not a sequence of integers"),
    "offset past the end": (lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "offsets", torch.Size([1])),
                            FormatError, "outside its size"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_metadata_is_a_format_error(tmp_path: Path, case: str) -> None:
    mutate, exc, msg = BAD[case]
    src = write_dcp(tmp_path / "src", {"w": ((4,), [((0,), torch.zeros(4))])}, mutate=mutate)
    with pytest.raises(exc, match=msg):
        import_dcp(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_cli_reports_each_malformed_metadata_in_one_line(tmp_path: Path) -> None:
    """`ckpt import dcp`: exit 3, one `error:` line naming the value, no traceback, nothing
    written (these were 9 tracebacks on 3930a40). Every case runs through the CLI's own entry
    point in this process (click's runner: the same error mapping, no interpreter start-up
    each); two run as real processes, for what only a process shows (the exit status and
    stderr as a shell sees them)."""
    import os
    import subprocess
    import sys

    from click.testing import CliRunner

    from ckpt_cli.main import cli

    repo = Path(__file__).resolve().parents[2]
    cases = sorted(BAD)
    for case in cases:
        write_dcp(tmp_path / case, {"w": ((4,), [((0,), torch.zeros(4))])}, mutate=BAD[case][0])

    def check(case: str, code: int | None, stderr: str) -> None:
        err = stderr.strip().splitlines()
        assert code == 3 and "Traceback" not in stderr, (case, code, stderr[-1500:])
        assert len(err) == 1 and err[0].startswith("error: ") and BAD[case][2] in err[0], (case, err)
        assert not (tmp_path / f"out-{case}").exists(), case

    runner = CliRunner(env={"CKPT_PROGRESS": "0"})
    for case in cases:
        r = runner.invoke(cli, ["import", "dcp", str(tmp_path / case), str(tmp_path / f"out-{case}")])
        assert r.exception is None or isinstance(r.exception, SystemExit), (case, r.exc_info)
        check(case, r.exit_code, r.stderr)
    for case in (cases[0], cases[-1]):
        p = hangs.run([sys.executable, "-m", "ckpt_cli", "import", "dcp", str(tmp_path / case),
                       str(tmp_path / f"out-{case}")], cwd=repo, capture_output=True, text=True,
                      bound_s=hangs.hang_s(30), env=dict(os.environ, CKPT_PROGRESS="0"))
        assert isinstance(p, subprocess.CompletedProcess)
        check(case, p.returncode, p.stderr)
