"""A fault-injecting ``Storage``: every byte a checkpoint writes or reads passes the seam
(``ckpt.storage``), so one wrapper can fail, tear, crash or reorder any of it.

``FaultyStorage(inner, plan)`` delegates to ``inner`` (the POSIX backend, or S3) and counts
every operation; the :class:`FaultPlan` decides, from a seed, what happens at which
operation:

* ``eio`` / ``enospc``: the operation raises ``OSError`` with that errno (nothing done);
* ``torn``: a ``write`` hands a prefix of its bytes to the file, then the process dies;
* ``crash``: the process dies before the operation (:class:`SimCrash`, a ``BaseException``
  so that no ``except Exception`` in the code under test can swallow a death). Every
  later operation from any thread dies too, as the threads of a dead process would;
* ``sigkill``: the real process dies before the operation (SIGKILL), for a test that
  runs the code under test in a child process and looks at what the death left;
* ``refuse``: a ``link`` or ``exchange`` is not done and says so (returns False), as on a
  backend without the capability; on any other operation it is a plan error.

The plan names operations by index (``kinds``), or by what they are (``rules``: the
operation's name, or one of several names, and the end of its path, e.g. the first
``close`` of a ``.safetensors`` file); a rule can be switched on and off while the test
runs. A ``crash`` or ``sigkill`` rule with ``after=True`` lets its operation complete and
kills the process before the next operation begins (from any thread): the instant just
after the operation, as far as anything reaching the storage can tell.

After a crash, :meth:`FaultyStorage.power_loss` turns the directory tree into one that a
machine could show after losing power at that moment (the POSIX model of spec §10.7):

* a file's bytes are durable once its sink closed with ``durable=True`` (fsync); an
  unsynced file keeps a random prefix of what was written;
* a name (create, mkdir, rename, link, remove) is durable once its parent directory was
  fsynced after it; every other name operation independently did or did not persist.
  Names are undone newest first, each later rename that did persist carried over to the
  older paths, so the tree is always one that some order of persisting could produce.

``remove_tree`` and ``remove_file`` move the tree or file to a trash folder instead of
deleting it, so that an unsynced removal can come back.

The commit protocol (``storage.commit``) is the inner backend's, bound to this wrapper
(``Commit.over``): a rename commit's operations are the ones above, and an object
store's commit requests (``begin``, ``publish``, ...) are one fault point each.

Faults at rest, between operations: :func:`flip_bit` (a media fault or an
``rsync --inplace``: one bit of a file changed in place, size and mtime kept) and
:func:`replace_file`.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

__all__ = ["SimCrash", "FaultPlan", "FaultRule", "FaultyStorage", "flip_bit", "replace_file", "committed_files"]

FaultKind = Literal["eio", "enospc", "torn", "crash", "sigkill", "refuse"]


class SimCrash(BaseException):
    """The simulated process died at this operation."""


@dataclass
class FaultRule:
    """``kind`` at the operations named ``op`` (a name, several, or any when empty) on a
    path ending with ``suffix``, after skipping ``skip`` of them, at most ``times`` times
    (None: every one after that), while ``armed``. ``after``: the operation is done and
    the process dies before the next one (``crash`` and ``sigkill`` only)."""

    kind: FaultKind
    op: str | tuple[str, ...] = ""
    suffix: str = ""
    skip: int = 0
    times: int | None = 1
    armed: bool = True
    after: bool = False
    seen: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        if self.after and self.kind not in ("crash", "sigkill"):
            raise ValueError(f"after=True is a death after the operation: crash or sigkill, not {self.kind}")

    def fires(self, name: str, path: str) -> bool:
        if not self.armed or not path.endswith(self.suffix):
            return False
        if self.op and name not in ((self.op,) if isinstance(self.op, str) else self.op):
            return False
        self.seen += 1
        if self.seen <= self.skip or (self.times is not None and self.fired >= self.times):
            return False
        self.fired += 1
        return True


@dataclass
class FaultPlan:
    """Which operation fails, and how. ``at`` counts operations from 0 in the order the
    wrapper sees them; ``kinds`` gives the fault at each such index, ``rules`` by what
    the operation is (the first rule that fires wins, an index before any rule)."""

    kinds: dict[int, FaultKind] = field(default_factory=dict)
    rules: list[FaultRule] = field(default_factory=list)

    @classmethod
    def one(cls, at: int, kind: FaultKind) -> "FaultPlan":
        return cls({at: kind})

    @classmethod
    def on(cls, kind: FaultKind, op: str = "", suffix: str = "", **rule: Any) -> "FaultPlan":
        """One rule (see :class:`FaultRule`): ``FaultPlan.on("enospc", "create", ".safetensors")``."""
        return cls(rules=[FaultRule(kind, op, suffix, **rule)])

    def fault(self, i: int, name: str, path: str) -> tuple[FaultKind | None, FaultRule | None]:
        """The fault at this operation, and the rule that chose it (None for an index)."""
        if i in self.kinds:
            return self.kinds[i], None
        rule = next((r for r in self.rules if r.fires(name, path)), None)
        return (rule.kind, rule) if rule is not None else (None, None)


@dataclass
class _NameOp:
    """One name operation not yet made durable by an fsync of its parent directory."""

    kind: str  # create mkdir rename link remove
    path: str  # the new name (create/mkdir/link), the destination (rename), the removed path
    src: str = ""  # rename: the old name; remove: where the tree sits in the trash
    dirs: tuple[str, ...] = ()  # the directories whose fsync makes it durable
    durable: bool = False


class _Sink:
    def __init__(self, owner: "FaultyStorage", path: str, inner: Any, durable: bool) -> None:
        self._owner = owner
        self._path = path
        self._inner = inner
        self._durable_on_close = durable
        self.written = 0

    def write(self, data: memoryview | bytes) -> None:
        kind = self._owner._op("write", self._path)
        if kind == "torn":
            mv = memoryview(data).cast("B")
            cut = self._owner.rng.randrange(0, len(mv) + 1)
            self._inner.write(bytes(mv[:cut]))
            self._inner.flush()
            self.written += cut
            self._owner._die(f"torn write of {self._path} after {cut} of {len(mv)} bytes")
        self._inner.write(data)
        self.written += len(memoryview(data).cast("B"))

    def write_copy(self, data: memoryview | bytes) -> None:
        # a copy first, so that a torn write cuts the bytes the caller handed over
        self.write(bytes(memoryview(data).cast("B")))

    def flush(self) -> None:
        self._inner.flush()

    def seal(self) -> tuple[int, bytes] | None:
        return None  # the plain sink: every file durable at its own close

    def close(self) -> tuple[int, bytes]:
        self._owner._op("close", self._path)
        out = self._inner.close()
        self._owner._file_closed(self._path, self._durable_on_close)
        return out

    def discard(self) -> None:
        # Discarding is cleanup on the way out of an error: a dead process does nothing.
        if self._owner.crashed:
            return
        self._inner.discard()


class _SealableSink(_Sink):
    """A sink whose inner sink can be sealed (the local one): ``ckpt.save`` of a small
    state then commits fused (spec §10.7), and the bytes stay unsynced until ``close``."""

    def seal(self) -> tuple[int, bytes]:
        self._owner._op("seal", self._path)
        return self._inner.seal()


class _Handle:
    def __init__(self, owner: "FaultyStorage", inner: Any) -> None:
        self._owner = owner
        self._inner = inner
        self.path = inner.path

    def pread_into(self, offset: int, buf: memoryview) -> int:
        self._owner._op("pread", self.path)
        return self._inner.pread_into(offset, buf)

    def size(self) -> int:
        return self._inner.size()

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:  # fd, map_private: the local fast paths
        return getattr(self._inner, name)


class FaultyStorage:
    """``inner`` with faults injected by ``plan``; see the module docstring."""

    def __init__(self, inner: Any, plan: FaultPlan | None = None, *, seed: int = 0, trash: str | None = None,
                 on_op: Callable[[int, str, str], None] | None = None) -> None:
        self.inner = inner
        self.scheme = inner.scheme
        self.plan = plan or FaultPlan()
        self.rng = random.Random(seed)
        self.ops = 0
        self.log: list[tuple[int, str, str]] = []
        self.crashed = False
        self.crash_reason = ""
        self.injected: list[tuple[int, str, str, str]] = []  # (op, kind, name, path)
        self._lock = threading.RLock()
        self._names: list[_NameOp] = []
        self._unsynced: dict[str, int] = {}  # file -> bytes the process wrote (not fsynced)
        self._sinks: dict[str, _Sink] = {}
        self._trash = trash
        self._trash_n = 0
        self._on_op = on_op
        self._dies_next: tuple[FaultKind, str] | None = None  # an after=True death, due at the next operation

    # -- the fault point -------------------------------------------------------------
    def _die(self, why: str) -> None:
        with self._lock:
            self.crashed = True
            self.crash_reason = self.crash_reason or why
        raise SimCrash(why)

    def _op(self, name: str, path: str) -> FaultKind | None:
        with self._lock:
            if self.crashed:
                raise SimCrash(f"the process is dead ({self.crash_reason}); {name} {path}")
            due, self._dies_next = self._dies_next, None
        if due is not None:
            # the death an after=True rule chose at the operation before this one
            if due[0] == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            self._die(due[1])
        with self._lock:
            i = self.ops
            self.ops += 1
            self.log.append((i, name, path))
            kind, rule = self.plan.fault(i, name, path)
            if kind is not None:
                self.injected.append((i, kind, name, path))
            if rule is not None and rule.after:
                self._dies_next = (kind, f"crash after operation {i} ({name} {path})")
                kind = None
        if self._on_op is not None:
            self._on_op(i, name, path)
        if kind == "crash":
            self._die(f"crash at operation {i} ({name} {path})")
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind in ("eio", "enospc"):
            code = errno.EIO if kind == "eio" else errno.ENOSPC
            raise OSError(code, f"{os.strerror(code)} (injected at operation {i}, {name})", path)
        return kind  # "torn" is the sink's to act on; elsewhere it is a plain crash
        # (see _op_plain)

    def _op_plain(self, name: str, path: str, *, refusable: bool = False) -> bool:
        """Count the operation and inject its fault; False: a ``refuse`` (do not do it)."""
        kind = self._op(name, path)
        if kind == "torn":
            self._die(f"crash at operation {self.ops - 1} ({name} {path})")
        if kind == "refuse" and not refusable:
            raise ValueError(f"a {name} cannot be refused (only link and exchange report not doing it)")
        return kind != "refuse"

    # -- name bookkeeping (the power-loss model) ------------------------------------
    def _name(self, kind: str, path: str, src: str = "", dirs: tuple[str, ...] = ()) -> None:
        with self._lock:
            self._names.append(_NameOp(kind, path, src, dirs or (os.path.dirname(path),)))

    def _file_closed(self, path: str, durable: bool) -> None:
        with self._lock:
            if durable:
                self._unsynced.pop(path, None)
            sink = self._sinks.pop(path, None)
            if not durable and sink is not None:
                self._unsynced[path] = sink.written

    # -- Storage ----------------------------------------------------------------------
    def normalize(self, path: Any) -> str:
        return self.inner.normalize(path)

    def realpath(self, path: str) -> str:
        return self.inner.realpath(path)

    def readlink(self, path: str) -> str:
        return self.inner.readlink(path)

    def create(self, path: str, chunk_size: int, *, durable: bool = True) -> _Sink:
        self._op_plain("create", path)
        inner = self.inner.create(path, chunk_size, durable=durable)
        sink = (_SealableSink if callable(getattr(inner, "seal", None)) else _Sink)(self, path, inner, durable)
        with self._lock:
            self._sinks[path] = sink
            self._unsynced[path] = 0
        if self.scheme == "file":
            self._name("create", path)
        return sink

    def open_read(self, path: str, *, reread: bool = False) -> _Handle:
        self._op_plain("open_read", path)
        return _Handle(self, self.inner.open_read(path, reread=reread))

    def pread_into(self, path: str, offset: int, buf: memoryview) -> int:
        self._op_plain("pread", path)
        return self.inner.pread_into(path, offset, buf)

    def read(self, path: str, offset: int, size: int) -> bytes:
        self._op_plain("read", path)
        return self.inner.read(path, offset, size)

    def lstat(self, path: str) -> os.stat_result:
        return self.inner.lstat(path)

    def listdir(self, path: str) -> list[str]:
        self._op_plain("listdir", path)
        names = self.inner.listdir(path)
        if self._trash is not None:
            names = [n for n in names if os.path.join(path, n) != self._trash]
        return names

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def isfile(self, path: str) -> bool:
        return self.inner.isfile(path)

    def isdir(self, path: str) -> bool:
        return self.inner.isdir(path)

    def mkdir(self, path: str) -> None:
        self._op_plain("mkdir", path)
        self.inner.mkdir(path)
        if self.scheme == "file":
            self._name("mkdir", path)

    def makedirs(self, path: str) -> None:
        # Parents that already exist are no new names; a made one is treated like mkdir.
        missing = []
        p = path
        while self.scheme == "file" and p and not self.inner.exists(p):
            missing.append(p)
            p = os.path.dirname(p)
        self._op_plain("makedirs", path)
        self.inner.makedirs(path)
        if self.scheme == "file":
            for m in reversed(missing):
                self._name("mkdir", m)

    def rename_dir(self, src: str, dst: str) -> None:
        self._op_plain("rename", dst)
        self.inner.rename_dir(src, dst)
        self._renamed(src, dst)

    def rename_noreplace(self, src: str, dst: str) -> None:
        self._op_plain("rename", dst)
        self.inner.rename_noreplace(src, dst)
        self._renamed(src, dst)

    def exchange(self, a: str, b: str) -> bool:
        if not self._op_plain("exchange", b, refusable=True):
            return False
        done = self.inner.exchange(a, b)
        if done and self.scheme == "file":
            # An exchange is two renames in one step; the model keeps it whole (both
            # names in one parent: the commit's overwrite path).
            self._name("exchange", b, a, (os.path.dirname(a), os.path.dirname(b)))
        return done

    def _renamed(self, src: str, dst: str) -> None:
        if self.scheme == "file":
            self._name("rename", dst, src, (os.path.dirname(src), os.path.dirname(dst)))

    def remove_tree(self, path: str) -> None:
        self._remove("remove_tree", path, self.inner.remove_tree)

    def remove_file(self, path: str) -> None:
        self._remove("remove_file", path, self.inner.remove_file)

    def _remove(self, op: str, path: str, remove: Callable[[str], None]) -> None:
        self._op_plain(op, path)
        if self.scheme != "file" or self._trash is None or not os.path.lexists(path):
            remove(path)
            return
        # kept in the trash, so that a power loss before the parent's fsync can bring it back
        with self._lock:
            self._trash_n += 1
            where = os.path.join(self._trash, f"{self._trash_n:06d}")
        os.makedirs(self._trash, exist_ok=True)
        os.rename(path, where)
        self._name("remove", path, where)

    def fsync_dir(self, path: str) -> None:
        self._op_plain("fsync_dir", path)
        self.inner.fsync_dir(path)
        with self._lock:
            for n in self._names:
                if not n.durable and path in n.dirs:
                    # a rename needs both of its directories' entries; a real filesystem
                    # journals the pair together, so either fsync makes it durable
                    n.durable = True

    def link(self, src: str, dst: str) -> bool:
        if not self._op_plain("link", dst, refusable=True):
            return False
        done = self.inner.link(src, dst)
        if done and self.scheme == "file":
            self._name("link", dst)
        return done

    def etag(self, path: str) -> str | None:
        return self.inner.etag(path)

    # -- the commit protocol (ckpt.storage.commit) -----------------------------------
    @property
    def strict_listing(self) -> bool:
        return self.inner.strict_listing

    @property
    def commit(self) -> Any:
        # The inner backend's protocol, making its requests through this wrapper: a rename
        # commit's renames, fsyncs and removals are the operations above; an object
        # store's commit requests are the methods below, one fault point each.
        return self.inner.commit.over(self)

    def _store_call(self, name: str, *args: Any, **kw: Any) -> Any:
        self._op_plain(name, str(args[0]) if args else "")
        return getattr(self.inner, name)(*args, **kw)

    def begin(self, final: str, *, overwrite: bool) -> Any:
        return self._store_call("begin", final, overwrite=overwrite)

    def publish(self, pending: Any, manifest: bytes, **fence: Any) -> None:
        self._store_call("publish", pending, manifest, **fence)

    def abort(self, pending: Any) -> None:
        self._store_call("abort", pending)

    def recover(self, parent: str, *, names: Callable[[str], bool] | None = None, **fence: Any) -> Any:
        return self._store_call("recover", parent, names=names, **fence)

    def remove_checkpoint(self, path: str, **fence: Any) -> bool:
        return bool(self._store_call("remove_checkpoint", path, **fence))

    def lock(self, run_dir: str, *, owner: dict[str, object] | None = None) -> Any:
        return self._store_call("lock", run_dir, owner=owner)

    def ledger_dir(self, run_dir: str) -> str:
        return str(self.inner.ledger_dir(run_dir))

    def __getattr__(self, name: str) -> Any:  # the inner backend's own extras (stats, bucket, walk)
        return getattr(self.inner, name)

    # -- after a crash --------------------------------------------------------------
    def power_loss(self, rng: random.Random | None = None) -> list[str]:
        """Make the tree one that a power loss at the crash could leave (see module doc).
        Returns what was undone, for the failure report."""
        rng = rng or self.rng
        undone: list[str] = []
        if self.scheme != "file":
            return undone
        with self._lock:
            names = list(self._names)
            unsynced = dict(self._unsynced)
            for path, sink in self._sinks.items():
                unsynced[path] = sink.written
        # file bytes first (their names are resolved through the renames below)
        kept_renames: list[tuple[str, str]] = []  # (src, dst) of later renames that persisted

        def now(p: str) -> str:
            for src, dst in kept_renames[::-1]:  # oldest kept rename first
                if p == src or p.startswith(src + os.sep):
                    p = dst + p[len(src):]
            return p

        persisted = {id(n): n.durable or rng.random() < 0.5 for n in names}
        for n in reversed(names):
            if persisted[id(n)]:
                if n.kind == "rename":
                    kept_renames.append((n.src, n.path))
                continue
            path = now(n.path)
            if n.kind in ("create", "link", "mkdir"):
                if os.path.lexists(path):
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path)
                    else:
                        os.unlink(path)
                    undone.append(f"{n.kind} {path}")
            elif n.kind == "rename":
                if os.path.lexists(path) and not os.path.lexists(n.src):
                    os.rename(path, n.src)
                    undone.append(f"rename {n.src} -> {path}")
            elif n.kind == "exchange":
                if os.path.lexists(path) and os.path.lexists(now(n.src)):
                    os.rename(path, path + ".simswap")
                    os.rename(now(n.src), path)
                    os.rename(path + ".simswap", now(n.src))
                    undone.append(f"exchange {n.src} <-> {path}")
            elif n.kind == "remove":
                if not os.path.lexists(path) and os.path.lexists(n.src):
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    os.rename(n.src, path)
                    undone.append(f"remove {path}")
        for path, written in unsynced.items():
            # where the file's name survived, its unsynced bytes may not have
            for src, dst in kept_renames[::-1]:
                if path == src or path.startswith(src + os.sep):
                    path = dst + path[len(src):]
            if os.path.isfile(path) and not os.path.islink(path):
                size = os.path.getsize(path)
                keep = rng.randrange(0, size + 1) if size else 0
                if keep < size:
                    os.truncate(path, keep)
                    undone.append(f"unsynced bytes {path}[{keep}:{size}]")
        with self._lock:
            self._names.clear()
            self._unsynced.clear()
            self._sinks.clear()
        return undone


def committed_files(root: str) -> list[str]:
    """Every regular file below ``root`` (the trash folder excluded), sorted."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != ".simtrash")
        for f in sorted(files):
            p = os.path.join(d, f)
            if not os.path.islink(p):
                out.append(p)
    return out


def flip_bit(path: str, rng: random.Random) -> tuple[int, int]:
    """Flip one bit of ``path`` in place, keeping its size and times (a media fault, or
    ``rsync --inplace``). Returns (byte offset, bit)."""
    st = os.stat(path)
    if st.st_size == 0:
        raise ValueError(f"{path} is empty")
    off = rng.randrange(st.st_size)
    bit = rng.randrange(8)
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)[0]
        f.seek(off)
        f.write(bytes([b ^ (1 << bit)]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return off, bit


def replace_file(path: str, data: bytes) -> None:
    """Give ``path`` other bytes under the same name (a new inode, as a copy tool would)."""
    tmp = path + ".simnew"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
