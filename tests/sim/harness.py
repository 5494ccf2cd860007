"""Deterministic fault simulation of every checkpoint write path (FoundationDB-style).

A *trial* is ``(write path, seed)``. From the seed it draws one fault (an operation index
and a kind: EIO, ENOSPC, a torn write, a crash with power loss, or a bit flipped at rest
between two saves) and runs the write path against :class:`~tests.sim.faultfs.FaultyStorage`
in a child process forked from a server that has imported torch once (fast, and a dead
"process" takes its locks and threads with it, as a real one does). The child records
every state it tried to save and which saves returned; after a crash it makes the tree
one that a power loss could leave. The parent, a fresh "process" after the reboot, then
checks the invariants (:func:`check`):

* **V1 verify = load**: every committed checkpoint either verifies and loads, or fails both;
* **V2 no wrong data**: what loads equals, bit for bit, a state that was saved under that name;
* **V3 all or nothing**: a load that fails leaves every target tensor as it was;
* **V4 durability**: a save that returned is still there, verifies and loads (unless a later
  save replaced it by design: an overwrite, retention), and the newest one always is;
* **V5 recovery**: a fresh writer (``recover`` / ``CheckpointManager.resume``) starts without
  error, resumes at least the newest returned step, and saves again;
* **V6 typed errors**: a fault surfaces as ``OSError`` or ``ckpt.errors.CkptError``, never
  another exception.

``python bench/sim.py --trials N`` is the long run (``make fuzz``); the suite runs
a seeded budget (tests/sim/test_sim.py). A violation prints the seed that reproduces it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.sim.faultfs import FaultPlan, FaultyStorage, SimCrash, committed_files, flip_bit  # noqa: E402

__all__ = ["WRITE_PATHS", "FAULTS", "Trial", "Outcome", "run_trial", "run_many", "check"]

FAULTS = ("eio", "enospc", "torn", "crash", "flip")
STEPS = 5  # saves per trial: enough for retention, dedup sharing and overwrite chains


# -- the state every write path saves: a tiny model, AdamW, a generator ---------------------


def _make_state(seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # a frozen tensor that never changes: what dedup shares between checkpoints
    frozen = torch.randn(64, 64, generator=g)
    return {"model": model, "optim": opt, "frozen": {"table": frozen}}


def _train_step(state: dict[str, Any], step: int) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 8, generator=g)
    loss = state["model"](x).pow(2).mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of the state, by a stable name (cloned)."""
    import torch

    out: dict[str, Any] = {}
    for k, v in state["model"].state_dict().items():
        out[f"model.{k}"] = v.detach().clone()
    for pid, s in state["optim"].state_dict()["state"].items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{pid}.{k}"] = v.detach().clone()
    out["frozen.table"] = state["frozen"]["table"].clone()
    return out


# -- write paths ------------------------------------------------------------------------------
# Each takes (fs, root, rec) and saves STEPS times; rec.attempt() before a save records what
# it saves under which name, rec.returned() after it returns.


class Recorder:
    def __init__(self, root: str, data: str) -> None:
        self.root = root
        self.data = data
        self.attempts: list[dict[str, Any]] = []
        self.flip: dict[str, Any] | None = None
        self._n = 0

    def attempt(self, name: str, step: int, state: dict[str, Any]) -> int:
        from safetensors.torch import save_file

        self._n += 1
        exp = os.path.join(self.root, "expected", f"{self._n:04d}.safetensors")
        os.makedirs(os.path.dirname(exp), exist_ok=True)
        save_file({k: v.contiguous() for k, v in _flat(state).items()}, exp)
        self.attempts.append({"name": name, "step": step, "expected": exp, "returned": False})
        return len(self.attempts) - 1

    def returned(self, i: int) -> None:
        self.attempts[i]["returned"] = True


def _between(fs: FaultyStorage, rec: Recorder, trial: "Trial", k: int, rng: random.Random) -> None:
    """The at-rest fault: after save ``k`` (drawn from the seed), flip one bit of a file of
    a committed checkpoint in place, as a disk or ``rsync --inplace`` would."""
    if trial.fault != "flip" or k != trial.flip_after:
        return
    if trial.s3 is not None:
        _flip_object(fs.inner, rec, rng)
        return
    files = [f for f in committed_files(rec.data) if ".tmp-" not in f and "/.ckpt" not in f]
    files = [f for f in files if os.path.getsize(f) > 0]
    if not files:
        return
    shared = [f for f in files if os.stat(f).st_nlink > 1]
    # Half the time a file that dedup shares between checkpoints (the worst case: every
    # holder is damaged at once, and the next save would link it again).
    target = rng.choice(shared if shared and rng.random() < 0.5 else files)
    off, bit = flip_bit(target, rng)
    st = os.stat(target)
    rec.flip = {"file": target, "offset": off, "bit": bit, "ino": st.st_ino, "dev": st.st_dev,
                "existing": _committed_checkpoints(rec.data)}


def _flip_object(store: Any, rec: Recorder, rng: random.Random) -> None:
    """The object-store form of a damaged file: an object replaced by one with a bit flipped
    (a buggy copy tool, a bad sync): every other object keeps its bytes."""
    ckpts = _committed_checkpoints(rec.data)
    objs = [f"{c}/{n}" for c in ckpts for n in store.listdir(c)]
    objs = [o for o in objs if store.lstat(o).st_size > 0]
    if not objs:
        return
    target = rng.choice(objs)
    blob = bytearray(store.read_all(target))
    off, bit = rng.randrange(len(blob)), rng.randrange(8)
    blob[off] ^= 1 << bit
    store.put(target, bytes(blob))
    rec.flip = {"file": target, "offset": off, "bit": bit, "ino": target, "dev": "s3", "existing": ckpts}


def _plain_path(**opts: Any) -> Callable[..., None]:
    """``ckpt.save`` STEPS times: to a new name per step, or (``overwrite``) to one name."""
    one_name = bool(opts.get("overwrite"))

    def run(fs: FaultyStorage, data: str, rec: Recorder, trial: "Trial", rng: random.Random) -> None:
        import ckpt

        state = _make_state(trial.seed)
        for step in range(1, STEPS + 1):
            _train_step(state, step)
            name = os.path.join(data, "latest" if one_name else f"step-{step:08d}")
            i = rec.attempt(name, step, state)
            ckpt.save(name, state, step=step, storage=fs, **opts)
            rec.returned(i)
            _between(fs, rec, trial, step, rng)

    return run


def wp_parts(fs: FaultyStorage, data: str, rec: Recorder, trial: "Trial", rng: random.Random) -> None:
    """begin / write_part x2 (part manifests, format 2.0) / commit: the many-rank path."""
    import ckpt
    from ckpt.writer import abort, begin, commit, write_part

    state = _make_state(trial.seed)
    for step in range(1, STEPS + 1):
        _train_step(state, step)
        name = os.path.join(data, f"step-{step:08d}")
        i = rec.attempt(name, step, state)
        pending = begin(name, storage=fs, part_manifests=True)
        try:
            a = write_part(pending, "rank-00000", {"model": state["model"], "optim": state["optim"], "frozen": state["frozen"]},
                           step=step, storage=fs)
            b = write_part(pending, "rank-00001", {"frozen": state["frozen"]}, step=step, storage=fs)
            commit(pending, [a, b], step=step, storage=fs)
        except BaseException:
            if not fs.crashed:
                abort(pending, storage=fs)
            raise
        rec.returned(i)
        _between(fs, rec, trial, step, rng)
    del ckpt


def _manager_path(**opts: Any) -> Callable[..., None]:
    def run(fs: FaultyStorage, data: str, rec: Recorder, trial: "Trial", rng: random.Random) -> None:
        from ckpt import CheckpointManager, RetentionPolicy

        state = _make_state(trial.seed)
        mgr = CheckpointManager(data, state, storage=fs, retention=RetentionPolicy(keep_last=2), ledger=False, **opts)
        try:
            for step in range(1, STEPS + 1):
                _train_step(state, step)
                i = rec.attempt(os.path.join(data, f"step-{step:08d}"), step, state)
                mgr.save(step)
                mgr.wait()
                rec.returned(i)
                _between(fs, rec, trial, step, rng)
        finally:
            if not fs.crashed:
                mgr.close()

    return run


def wp_rewind(fs: FaultyStorage, data: str, rec: Recorder, trial: "Trial", rng: random.Random) -> None:
    """Save, roll back (``CheckpointManager.rewind``: load an older step and delete the newer
    timeline), then save the new timeline over the same step numbers."""
    from ckpt import CheckpointManager, RetentionPolicy

    state = _make_state(trial.seed)
    mgr = CheckpointManager(data, state, storage=fs, retention=RetentionPolicy(keep_last=3), ledger=False)
    try:
        steps = list(range(1, STEPS + 1))
        for step in steps[:3]:
            _train_step(state, step)
            i = rec.attempt(os.path.join(data, f"step-{step:08d}"), step, state)
            mgr.save(step)
            rec.returned(i)
            _between(fs, rec, trial, step, rng)
        mgr.rewind(before=3)  # back to step 2; step 3 is discarded
        rec.attempts = [a for a in rec.attempts if a["step"] < 3 or not a["returned"]] + \
            [dict(a, returned=False) for a in rec.attempts if a["step"] >= 3 and a["returned"]]
        for step in steps[2:]:
            _train_step(state, step + 100)  # another timeline: other values under the same names
            i = rec.attempt(os.path.join(data, f"step-{step:08d}"), step, state)
            mgr.save(step)
            rec.returned(i)
            _between(fs, rec, trial, step, rng)
    finally:
        if not fs.crashed:
            mgr.close()


def wp_distributed(fs: FaultyStorage, data: str, rec: Recorder, trial: "Trial", rng: random.Random) -> None:
    """``ckpt.distributed.DistributedCheckpointer.save`` (the collective save) in a
    one-rank gloo group."""
    import torch.distributed as dist

    from ckpt.distributed import DistributedCheckpointer

    store = dist.FileStore(os.path.join(rec.root, "pg-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        dc = DistributedCheckpointer()
        state = _make_state(trial.seed)
        for step in range(1, STEPS + 1):
            _train_step(state, step)
            name = os.path.join(data, f"step-{step:08d}")
            i = rec.attempt(name, step, state)
            dc.save(name, state, step=step, storage=fs)
            rec.returned(i)
            _between(fs, rec, trial, step, rng)
    finally:
        if not fs.crashed:
            dist.destroy_process_group()


WRITE_PATHS: dict[str, Callable[..., None]] = {
    "save": _plain_path(),
    "overwrite": _plain_path(overwrite=True),
    "compress": _plain_path(compress=True),
    "parts": wp_parts,
    "manager": _manager_path(),
    "manager-async": _manager_path(async_save=True),
    "manager-dedup": _manager_path(dedup=True),
    "rewind": wp_rewind,
    "distributed": wp_distributed,
}
MANAGED = {"manager", "manager-async", "manager-dedup", "s3-manager", "rewind"}
#: the same write paths against the object store (the test server): commit by MANIFEST-last
S3_PATHS: dict[str, Callable[..., None]] = {
    "s3-save": _plain_path(),
    "s3-overwrite": _plain_path(overwrite=True),
    "s3-manager": _manager_path(),
}


# -- a trial ----------------------------------------------------------------------------------


@dataclass
class Trial:
    path: str
    seed: int
    fault: str = ""
    at: int = -1  # operation index (I/O faults)
    flip_after: int = 0  # save index (at-rest faults)
    ops_total: int = 0
    #: object-store trials: {"env": AWS variables of the test server, "url": "s3://bucket/prefix"}
    s3: dict[str, Any] | None = None


@dataclass
class Outcome:
    trial: Trial
    result: str = ""  # completed / crashed / raised: <type>
    error: str = ""
    injected: list[Any] = field(default_factory=list)
    undone: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def report(self) -> str:
        t = self.trial
        head = f"[{t.path} seed={t.seed} fault={t.fault}@{t.at if t.fault != 'flip' else t.flip_after}] {self.result}"
        lines = [head] + [f"  VIOLATION {v}" for v in self.violations]
        if self.violations:
            lines += [f"  injected: {self.injected}", f"  error: {self.error[-2000:]}", f"  power loss undid: {self.undone[:20]}"]
            lines.append(f"  reproduce: python bench/sim.py --trials 1 --path {t.path} --seed {t.seed} --fault {t.fault}")
        return "\n".join(lines)


def _child(trial_json: str, root: str, out_file: str) -> None:
    """One life of the simulated process (runs in a forked child)."""
    import faulthandler

    import torch

    torch.set_num_threads(1)
    # A hang names itself: stacks to stderr, then the child exits (the parent reports it).
    faulthandler.dump_traceback_later(_hang_bound(), exit=True)
    trial = Trial(**json.loads(trial_json))
    rng = random.Random(trial.seed * 7919 + 17)
    data = _data(trial, root)
    if trial.s3 is None:
        os.makedirs(data, exist_ok=True)
    rec = Recorder(root, data)
    plan = FaultPlan.one(trial.at, trial.fault) if trial.fault in ("eio", "enospc", "torn", "crash") else FaultPlan()  # type: ignore[arg-type]
    fs = FaultyStorage(_inner(trial), plan, seed=trial.seed, trash=os.path.join(root, ".simtrash"))
    out: dict[str, Any] = {"result": "completed", "error": "", "undone": []}
    try:
        {**WRITE_PATHS, **S3_PATHS}[trial.path](fs, data, rec, trial, rng)
    except SimCrash as e:
        out["result"] = "crashed"
        out["error"] = str(e)
    except BaseException as e:  # noqa: BLE001 - classified by the parent (V6)
        if fs.crashed:
            out["result"] = "crashed"
            out["error"] = f"{type(e).__name__}: {e}"
        else:
            out["result"] = f"raised: {type(e).__module__}.{type(e).__qualname__}"
            out["error"] = "".join(traceback.format_exception(e))
            out["typed"] = _typed(e)
    if fs.crashed:
        fs.crashed = True
        out["undone"] = _quiesce_and_lose_power(fs)
    out["ops"] = fs.ops
    out["injected"] = fs.injected
    out["attempts"] = rec.attempts
    out["flip"] = rec.flip
    with open(out_file, "w") as f:
        json.dump(out, f)
    # Die as a process does: no atexit, no joining of threads a dead process would not join.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _quiesce_and_lose_power(fs: FaultyStorage) -> list[str]:
    # Threads of the dead process raise at their next storage operation; give them the
    # chance to reach it (they are not joined: a dead process joins nothing).
    import threading

    from ckpt import _helpers

    # Reused helper threads never exit: wait until none runs a call instead.
    _helpers.wait_idle(_hang_bound() / 10)
    for t in threading.enumerate():
        if t is not threading.current_thread() and t.name.startswith("ckpt") and t.name != _helpers.NAME:
            t.join(timeout=_hang_bound() / 10)
    return fs.power_loss(random.Random(fs.rng.random()))


def _typed(e: BaseException) -> bool:
    from ckpt.errors import CkptError

    return isinstance(e, (OSError, CkptError))


def _data(trial: Trial, root: str) -> str:
    """Where the trial's checkpoints live: a local folder, or a prefix of the test bucket."""
    if trial.s3 is None:
        return os.path.join(root, "data")
    return f"{trial.s3['url'].rstrip('/')}/{os.path.basename(os.path.dirname(root))}-{os.path.basename(root)}/data"


def _inner(trial: Trial) -> Any:
    if trial.s3 is None:
        from ckpt.storage import LocalStorage

        return LocalStorage()
    # The forkserver started before the test server: its environment comes with the trial.
    os.environ.update(trial.s3["env"])
    from ckpt.storage import forget_backends, resolve

    forget_backends()
    return resolve(trial.s3["url"])[0]


def _hang_bound() -> float:
    from ckpt.knobs import knobs

    scale = getattr(knobs(), "timeout_scale", 1.0) or 1.0
    return 300.0 * float(scale)


_CTX: Any = None


def _ctx() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "ckpt", "safetensors.torch", "tests.sim.harness"])
    return _CTX


def _live(trial: Trial, root: str) -> dict[str, Any]:
    out_file = os.path.join(root, "outcome.json")
    p = _ctx().Process(target=_child, args=(json.dumps(asdict(trial)), root, out_file))
    p.start()
    p.join()
    if not os.path.exists(out_file):
        return {"result": f"child died (exit {p.exitcode}): a hang (stacks on stderr) or a crash of the interpreter",
                "error": "", "undone": [], "ops": 0, "injected": [], "attempts": [], "flip": None}
    with open(out_file) as f:
        return json.load(f)


def plan_trial(path: str, seed: int, work: str, s3: dict[str, Any] | None = None, fault: str | None = None) -> Trial:
    """Draw the trial's fault from its seed (the dry run counts the write path's operations);
    ``fault`` fixes the kind, and the seed still draws where it strikes."""
    rng = random.Random(seed)
    drawn = FAULTS[rng.randrange(len(FAULTS))]
    fault = fault or drawn
    if fault == "flip":
        return Trial(path, seed, fault, flip_after=rng.randrange(1, STEPS), s3=s3)
    dry = os.path.join(work, "dry")
    os.makedirs(dry)
    got = _live(Trial(path, seed, s3=s3), dry)
    total = int(got.get("ops", 0))
    shutil.rmtree(dry, ignore_errors=True)
    if total <= 0:
        raise RuntimeError(f"the fault-free run of {path} did no storage operation: {got.get('result')}\n{got.get('error')}")
    return Trial(path, seed, fault, at=rng.randrange(total), ops_total=total, s3=s3)


def run_trial(path: str, seed: int, work: str | None = None, *, s3: dict[str, Any] | None = None,
              fault: str | None = None) -> Outcome:
    """One trial; ``s3`` (``{"env": ..., "url": "s3://bucket"}``) for the object-store paths."""
    own = work is None
    work = work or tempfile.mkdtemp(prefix="ckpt-sim-")
    try:
        trial = plan_trial(path, seed, work, s3, fault)
        root = os.path.join(work, "life")
        os.makedirs(root)
        got = _live(trial, root)
        outcome = Outcome(trial, got["result"], got.get("error", ""), got.get("injected", []), got.get("undone", []))
        outcome.violations = check(trial, root, got)
        return outcome
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


# -- the invariants ---------------------------------------------------------------------------


def _expected(path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(path)


def _load_check(ckpt_path: str, seed: int) -> tuple[bool, bool, dict[str, Any] | None, str]:
    """(verify ok, load ok, loaded tensors, why) with V3 checked inside: a failed load must
    leave its targets as they were."""
    import torch

    import ckpt
    from ckpt.errors import CkptError

    why = ""
    try:
        ckpt.open(ckpt_path).verify()
        verified = True
    except CkptError as e:
        verified, why = False, f"verify: {type(e).__name__}: {e}"
    target = _make_state(seed + 99991)
    _train_step(target, 0)  # optimizer state exists, so the load is in place
    before = _flat(target)
    try:
        parts = [p.name for p in ckpt.open(ckpt_path).parts]
        if len(parts) > 1:
            # every rank loads its own part on a resume: the checkpoint loads when all of them do
            # (rank-00000's into the targets compared below, the others into scratch targets)
            for name in parts[1:]:
                other = _make_state(seed + 99992)
                ckpt.load(ckpt_path, {"frozen": other["frozen"]}, part=name, restore_rng=False, exactness="off")
            ckpt.load(ckpt_path, {"model": target["model"], "optim": target["optim"], "frozen": target["frozen"]},
                      part="rank-00000", restore_rng=False, exactness="off")
        else:
            ckpt.load(ckpt_path, target, restore_rng=False, exactness="off")
        return verified, True, _flat(target), why
    except CkptError as e:
        after = _flat(target)
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        why += f" | load: {type(e).__name__}: {e}"
        if changed and not isinstance(e, ckpt.errors.CheckpointChangedError):
            why += f" | V3: a failed load changed targets {changed[:4]}"
        return verified, False, None, why


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _committed_checkpoints(data: str) -> list[str]:
    """The committed checkpoints below ``data`` (a folder or an s3:// prefix)."""
    if data.startswith("s3://"):
        from ckpt.storage import resolve

        store, root = resolve(data)
        try:
            names = store.listdir(root)
        except FileNotFoundError:
            return []
        return sorted(f"{root}/{n}" for n in names if store.isfile(f"{root}/{n}/MANIFEST"))
    out: list[str] = []
    if not os.path.isdir(data):
        return out
    for d, dirs, files in os.walk(data):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".tmp-"))
        if "MANIFEST" in files and not os.path.basename(d).startswith(".tmp-"):
            out.append(d)
    return sorted(out)


def _holds_inode(ckpt_path: str, flip: dict[str, Any] | None) -> bool:
    """Whether ``ckpt_path`` already existed when the bit was flipped and holds the damaged
    file: the only checkpoints a damaged file may cost (a save after the flip must not
    take the damage in, issue 22 item 2)."""
    if not flip or ckpt_path not in flip.get("existing", ()):
        return False
    if flip["dev"] == "s3":
        return flip["file"].startswith(ckpt_path + "/")
    for f in committed_files(ckpt_path):
        st = os.stat(f)
        if st.st_ino == flip["ino"] and st.st_dev == flip["dev"]:
            return True
    return False


def check(trial: Trial, root: str, got: dict[str, Any]) -> list[str]:
    import ckpt
    from ckpt.errors import CkptError

    v: list[str] = []
    data = _data(trial, root)
    if trial.s3 is not None:
        _inner(trial)  # this process reaches the same server
    attempts = got.get("attempts", [])
    flip = got.get("flip")
    if got["result"].startswith("child died"):
        return [got["result"]]
    if got["result"].startswith("raised") and not got.get("typed"):
        v.append(f"V6 untyped error escaped the write path: {got['error'][-1500:]}")
    if trial.fault == "flip" and got["result"] != "completed":
        v.append(f"V4 a save after a bit flipped at rest failed: {got['error'][-1500:]}")

    # Recovery first, as a restarted job would do it (it may legitimately restore a copy).
    resumed_step = None
    try:
        if trial.path in MANAGED:
            from ckpt import CheckpointManager, RetentionPolicy

            fresh = _make_state(trial.seed + 7)
            _train_step(fresh, 0)
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mgr = CheckpointManager(data, fresh, retention=RetentionPolicy(keep_last=2), ledger=False)
                res = mgr.resume()
            resumed_step = None if res is None else res.step
            if res is not None:
                exp = [a for a in attempts if a["step"] == res.step]
                if not any(_same(_flat(fresh), _expected(a["expected"])) for a in exp):
                    v.append(f"V2 resume() loaded step {res.step} with values no save of that step had")
            # V5: the restarted job can save again
            _train_step(fresh, 99)
            mgr.save(STEPS + 1)
            mgr.wait()
            mgr.close()
            ckpt.open(os.path.join(data, f"step-{STEPS + 1:08d}")).verify()
        else:
            from ckpt.writer import recover

            if trial.s3 is not None or os.path.isdir(data):
                recover(data)
    except (CkptError, OSError) as e:
        v.append(f"V5 recovery failed: {type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001
        v.append(f"V5/V6 recovery raised {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")

    # Every committed checkpoint: V1, V2, V3.
    status: dict[str, tuple[bool, bool, dict[str, Any] | None]] = {}
    for path in _committed_checkpoints(data):
        verified, loaded, tensors, why = _load_check(path, trial.seed)
        status[path] = (verified, loaded, tensors)
        if "V3" in why:
            v.append(f"{why[why.index('V3'):]} ({path})")
        if verified != loaded:
            v.append(f"V1 verify {'passed' if verified else 'failed'} but load {'passed' if loaded else 'failed'}: {path}: {why}")
        if loaded and tensors is not None:
            if path.endswith(f"step-{STEPS + 1:08d}"):
                continue
            cands = [a for a in attempts if a["name"] == path]
            if not any(_same(tensors, _expected(a["expected"])) for a in cands):
                v.append(f"V2 {path} loads values that no save of that name had")
        if not loaded and trial.fault != "flip":
            v.append(f"V1/V4 a committed checkpoint does not load and no byte was flipped at rest: {path}: {why}")
        if not loaded and trial.fault == "flip" and not _holds_inode(path, flip):
            v.append(f"V4 {path} does not load, but does not hold the damaged file {flip and flip['file']}: {why}")

    # V4: returned saves survive (the newest always; older ones unless replaced by design).
    returned = [a for a in attempts if a["returned"]]
    if returned:
        newest = returned[-1]
        later_attempts = attempts[attempts.index(newest) + 1:]
        ok = status.get(newest["name"], (False, False, None))[1]
        replaced_ok = any(status.get(a["name"], (False, False, None))[1] for a in later_attempts)
        damaged = trial.fault == "flip" and _holds_inode(newest["name"], flip)
        if not ok and not replaced_ok and not damaged:
            v.append(f"V4 the newest returned save {newest['name']} (step {newest['step']}) is gone or does not load")
        if trial.path in ("save", "compress", "parts", "s3-save", "distributed"):
            for a in returned:
                if not status.get(a["name"], (False, False, None))[1] and not (trial.fault == "flip" and _holds_inode(a["name"], flip)):
                    v.append(f"V4 returned save {a['name']} is gone or does not load")
        if resumed_step is not None or trial.path in MANAGED:
            good = [a["step"] for a in returned if not (trial.fault == "flip" and _holds_inode(a["name"], flip))]
            if good and (resumed_step is None or resumed_step < max(good)):
                v.append(f"V5 resume() chose step {resumed_step}, but step {max(good)} was saved (returned) and is undamaged")
    return v


# -- driving many ----------------------------------------------------------------------------


def run_many(trials: int, seed0: int = 0, paths: list[str] | None = None,
             progress: Callable[[Outcome], None] | None = None, fault: str | None = None,
             s3: dict[str, Any] | None = None) -> list[Outcome]:
    paths = paths or list(S3_PATHS if s3 else WRITE_PATHS)
    out = []
    for i in range(trials):
        path = paths[i % len(paths)]
        o = run_trial(path, seed0 + i, fault=fault, s3=s3 if path in S3_PATHS else None)
        out.append(o)
        if progress is not None:
            progress(o)
    return out


def summary(outcomes: list[Outcome]) -> str:
    rows: dict[str, list[int]] = {}
    for o in outcomes:
        r = rows.setdefault(o.trial.path, [0, 0, 0])
        r[0] += 1
        r[1] += len(o.injected) + (1 if o.trial.fault == "flip" else 0)
        r[2] += len(o.violations)
    lines = [f"{'write path':<16} {'trials':>7} {'faults':>7} {'violations':>10}"]
    for p, (n, f, bad) in rows.items():
        lines.append(f"{p:<16} {n:>7} {f:>7} {bad:>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=len(WRITE_PATHS) * 4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--path", choices=sorted({**WRITE_PATHS, **S3_PATHS}), action="append")
    ap.add_argument("--fault", choices=FAULTS)
    ap.add_argument("--s3", action="store_true",
                    help="the object-store write paths, against an S3-compatible server started here (moto)")
    a = ap.parse_args(argv)
    def show(o: Outcome) -> None:
        print(o.report() if o.violations else o.report().splitlines()[0], flush=True)

    server = None
    s3 = None
    if a.s3 or any(p in S3_PATHS for p in a.path or ()):
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from s3server import start

        server = start()
        server.create_bucket("ckpt-sim")
        s3 = {"env": server.env(), "url": "s3://ckpt-sim"}
    try:
        outcomes = run_many(a.trials, a.seed, a.path, progress=show, fault=a.fault, s3=s3)
    finally:
        if server is not None:
            server.stop()
    print(summary(outcomes))
    return 1 if any(o.violations for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
