"""One SaveContext record: the context keywords (step, config, data, generators, rng,
extra, lineage, code_dir) are declared at the public save calls only, with the record's
defaults, and every layer below takes the record and passes it on unchanged."""

from __future__ import annotations

import dataclasses
import inspect
import random
import types
from pathlib import Path
from typing import Any, Callable

import torch

import ckpt
from ckpt.context.record import SaveContext, lineage_of
from ckpt.dcp.integration import save_sharded, save_sharded_with
from ckpt.dcp.storage import StorageWriter
from ckpt.distributed import DistributedCheckpointer
from ckpt.manager import _saver
from ckpt.writer import _write_part, save, write_part, write_part_with

FIELDS = {f.name: f.default for f in dataclasses.fields(SaveContext)}

# where a user gives the context, as keywords (ckpt.save takes run_id/resumed_from for the
# lineage and always captures the RNG)
PUBLIC: dict[str, Callable[..., Any]] = {
    "ckpt.save": save,
    "ckpt.write_part": write_part,
    "DistributedCheckpointer.save": DistributedCheckpointer.save,
    "ckpt.dcp.StorageWriter": StorageWriter.__init__,
    "the sharded save": save_sharded,
}
# the layers below, which take the record
INNER: dict[str, Callable[..., Any]] = {
    "write_part_with": write_part_with,
    "_write_part": _write_part,
    "DistributedCheckpointer.save_with": DistributedCheckpointer.save_with,
    "StorageWriter.with_context": StorageWriter.with_context,
    "save_sharded_with": save_sharded_with,
}


def test_the_public_calls_declare_the_context_keywords_with_the_records_defaults() -> None:
    for where, fn in PUBLIC.items():
        params = inspect.signature(fn).parameters
        given = {n: params[n].default for n in FIELDS if n in params}
        expected = set(FIELDS) - ({"rng", "lineage"} if where == "ckpt.save" else set())
        assert set(given) == expected, where
        drifted = {n: d for n, d in given.items() if d != FIELDS[n]}
        assert drifted == {}, f"{where}: defaults other than SaveContext's: {drifted}"


def test_the_inner_layers_take_the_record_not_the_keywords() -> None:
    for where, fn in {**INNER, "the manager's save thread": _saver.write}.items():
        params = inspect.signature(fn).parameters
        assert not set(FIELDS) & set(params), f"{where} declares {sorted(set(FIELDS) & set(params))} again"
    for where, fn in INNER.items():
        assert str(inspect.signature(fn).parameters["context"].annotation) == "SaveContext", where
    assert [f.name for f in dataclasses.fields(_saver.SaveJob)].count("context") == 1


def test_keywords_and_the_record_write_the_same_context(tmp_path: Path) -> None:
    loader = types.SimpleNamespace(state_dict=lambda: {"pos": 3})  # all a save asks of data=
    state = {"w": torch.arange(6.0)}
    fields: dict[str, Any] = dict(step=7, config={"lr": 0.1}, data=loader, rng=False, extra={"note": "x"},
                                  lineage={"run_id": "r1", "resumed_from": None})
    record = SaveContext(**fields)
    pending = ckpt.begin(tmp_path / "c")
    by_keywords = ckpt.write_part(pending, "rank-00000", state, **fields)
    by_record = write_part_with(pending, "rank-00001", state, record)
    ckpt.commit(pending, [by_keywords, by_record])
    reader = ckpt.open(tmp_path / "c")
    keys = ("step", "config", "data", "data_type", "rng", "extra", "lineage")
    a, b = reader.context("rank-00000"), reader.context("rank-00001")
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert a["step"] == 7 and a["rng"] is None and a["data"] == {"pos": 3} and a["extra"] == {"note": "x"}
    assert a["lineage"] == {"run_id": "r1", "resumed_from": None} and reader.config("rank-00001") == {"lr": 0.1}
    # passed through unchanged: the caller's record and its objects are the ones it built
    assert record.data is fields["data"] and record.lineage is fields["lineage"]


def test_a_one_process_save_builds_its_lineage_from_run_id_and_resumed_from(tmp_path: Path) -> None:
    info = ckpt.save(tmp_path / "s", {"w": torch.ones(2)}, step=2, run_id="run-a", resumed_from="step-1")
    ctx = ckpt.open(info.path).context()
    assert ctx["lineage"] == lineage_of("run-a", "step-1") and ctx["step"] == 2 and ctx["rng"]


def test_the_rng_is_captured_when_asked_for_and_left_alone_otherwise() -> None:
    asked = SaveContext(step=1)
    random.seed(11)
    now = asked.with_rng_now()
    random.random()  # the loop draws on: the captured state is the one before
    assert now is not asked and isinstance(now.rng, dict) and asked.rng is True and now.step == 1
    random.setstate((now.rng["python"]["version"], tuple(now.rng["python"]["state"]), now.rng["python"]["gauss_next"]))
    replayed = random.random()
    random.seed(11)
    assert replayed == random.random()
    for rng in (False, {"python": None}):
        kept = SaveContext(rng=rng)
        assert kept.with_rng_now() is kept
