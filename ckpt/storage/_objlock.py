"""The run lock on an object store: a lease with a heartbeat, an expiry and a fencing token.

Why a lease: an object store cannot tell a dead holder from a live one, and the process
that holds a run may run anywhere, including in another PID namespace of this very host
(containers with host networking share the hostname and the boot id), where
``kill(pid, 0)`` says nothing about it. So the holder proves it is alive: a daemon
thread renews the lock object every ``lock_heartbeat_s`` with a conditional PUT
(``If-Match`` on the ETag it last wrote), and a contender takes the run over only once
the lock has gone unrenewed for the holder's whole lease (``lock_expiry_s``), with a
conditional PUT on the ETag it watched (spec/object-storage.md §O.6).

The fencing token is the lock object itself: every commit and every deletion made under
the lock first renews it with ``If-Match`` (:meth:`ObjectLock.fence`). A writer whose
lease was taken over fails there (``LeaseLostError``) instead of committing or deleting
over the new holder. What a lease cannot close (S3 has no multi-object transaction): a
writer paused for longer than the whole lease *between* its fence and its MANIFEST put
commits once after a takeover. The lease is sized so that this needs a pause of
``lock_expiry_s`` in the middle of one PUT.

Time: the holder's renewals and a contender's watch are measured on each process's own
monotonic clock (no clocks compared across machines). The wall-clock expiry written in
the lock is compared only where the clock is provably the same: a contender on the same
host and boot (containers share ``CLOCK_REALTIME``). A contender in the same PID
namespace may still ask ``kill(pid, 0)``: there a vanished pid is a dead holder.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
import weakref
from typing import Any, Protocol

from obstore.exceptions import AlreadyExistsError, PreconditionError

from .. import _forksafe
from ..errors import LeaseLostError, RunDirLockedError, StorageError

__all__ = ["ObjectLock", "LeaseClock", "SystemClock", "CLOCK", "LOCK_NAME"]

LOCK_NAME = ".ckpt-writer.lock"
_VERSION = 2  # lock objects of version 1 held a pid and no lease
_MAX_LOCK_BYTES = 4096  # ours are one short JSON line
#: a lease longer than this is not waited for: the contender refuses, naming the object
_MAX_WAIT_S = 3600.0


class LeaseClock(Protocol):
    """Where the lease code reads time and waits (tests inject a logical clock)."""

    def now(self) -> float: ...  # monotonic seconds: renewals, watches
    def wall(self) -> float: ...  # epoch seconds: what is written into the lock object
    def sleep(self, seconds: float, stop: threading.Event | None = None) -> bool: ...  # True: ``stop`` was set


class SystemClock:
    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float, stop: threading.Event | None = None) -> bool:
        if stop is None:
            time.sleep(max(0.0, seconds))
            return False
        return stop.wait(max(0.0, seconds))


#: the clock new locks use when none is passed (tests replace it)
CLOCK: LeaseClock = SystemClock()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_ns() -> str:
    """This process's PID namespace (its inode: unique per namespace within one boot)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _identity() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "boot": _boot_id(), "pidns": _pid_ns()}


class _Lease:
    """What the heartbeat thread needs (it holds no reference to the ObjectLock, so a
    lock dropped without ``release`` stops renewing and expires like a dead process's)."""

    def __init__(self, storage: Any, path: str, body: dict[str, Any], etag: str, clock: LeaseClock,
                 heartbeat_s: float, sent_at: float) -> None:
        self.storage = storage
        self.path = path
        self.body = body
        self.etag: str | None = etag
        self.clock = clock
        self.heartbeat_s = heartbeat_s
        self.expiry_s = float(body["lease_s"])
        #: when the PUT that last renewed the lease was *sent* (own monotonic clock): no
        #: contender can take over before ``renewed_at + expiry_s``
        self.renewed_at = sent_at
        self.renewals = 0
        self.lost: str | None = None  # why this process no longer holds the run
        self.mutex = threading.Lock()  # one conditional PUT at a time (heartbeat, fence)
        self.stop = threading.Event()

    def renew(self) -> None:
        with self.mutex:
            if self.lost is not None:
                raise LeaseLostError(self.lost, path=self.path)
            sent = self.clock.now()
            wall = self.clock.wall()
            self.body["renewed"] = wall
            self.body["expires"] = wall + self.expiry_s
            blob = json.dumps(self.body, sort_keys=True).encode()
            try:
                res = self.storage.put(self.path, blob, mode={"e_tag": self.etag})
            except (AlreadyExistsError, PreconditionError, FileNotFoundError):
                self.lost = ("this writer's lease on the run was taken over by another writer (its heartbeat "
                             f"could not renew it for {self.expiry_s:g} s, or the lock object was removed); "
                             "nothing more is committed or deleted through it")
                self.etag = None
                raise LeaseLostError(self.lost, path=self.path) from None
            self.etag = res.get("e_tag")
            self.renewed_at = sent
            self.renewals += 1

    def beat(self) -> None:
        """The heartbeat thread: renew every ``heartbeat_s`` until stopped or lost."""
        while not self.clock.sleep(self.heartbeat_s, self.stop):
            try:
                self.renew()
            except LeaseLostError:
                return
            except (StorageError, OSError):
                # The store is unreachable: try again next period. If it stays so for the
                # whole lease, a contender may take the run and the next fence fails.
                continue


class ObjectLock:
    """The run lock of an object store (``<run>/.ckpt-writer.lock``): a lease renewed by
    a daemon thread, taken over only after it expired. ``fence()`` before any commit or
    deletion under it (``ckpt.storage.FencedStorage`` does); ``release()`` is idempotent."""

    NAME = LOCK_NAME

    def __init__(self, storage: Any, run_dir: str, lease: _Lease) -> None:
        self.path = lease.path
        self.run_dir = run_dir
        self._lease = lease
        self._s = storage
        t = threading.Thread(target=lease.beat, name="ckpt-lease", daemon=True)
        # A lock dropped without release() stops renewing (and expires, like a dead holder's).
        self._finalizer = weakref.finalize(self, lease.stop.set)
        _forksafe.start(t)
        self._thread = t
        _held.add(self)

    # -- taking the lock ---------------------------------------------------------------
    @classmethod
    def acquire(cls, storage: Any, run_dir: str, *, owner: dict[str, object] | None = None,
                clock: LeaseClock | None = None) -> ObjectLock:
        """Create the lock object, or take it over from a holder whose lease expired.

        A holder that renews while this watches is alive: ``RunDirLockedError`` at once.
        A holder whose lease is in force and that does not renew is waited for, up to its
        whole lease (a crashed holder's lock is taken over that long after its last
        renewal), measured on this process's monotonic clock."""
        from ..knobs import knobs

        clock = clock or CLOCK
        k = knobs()
        path = f"{run_dir}/{LOCK_NAME}"
        me = _identity()
        token = secrets.token_hex(16)
        watched: str | None = None  # the holder's ETag being watched, and since when
        since = 0.0
        changed = 0  # times the lock changed hands under this contender
        while changed < 16:
            body = {**me, **(owner or {}), "v": _VERSION, "owner": token, "generation": 1,
                    "lease_s": k.lock_expiry_s, "heartbeat_s": k.lock_heartbeat_s, "since": clock.wall()}
            sent = clock.now()
            body["renewed"] = body["since"]
            body["expires"] = body["since"] + k.lock_expiry_s
            try:
                res = storage.put(path, json.dumps(body, sort_keys=True).encode(), mode="create")
                return cls._start(storage, run_dir, path, body, res, clock, k.lock_heartbeat_s, sent)
            except (AlreadyExistsError, PreconditionError):
                pass
            got = _read(storage, path)
            if got is None:
                changed += 1
                continue  # released meanwhile: create it again
            etag, holder = got
            verdict = _judge(holder, me, clock)
            if verdict == "live":
                raise _refusal(path, run_dir, holder, "it is held by this process")
            if verdict == "unknown":
                raise _refusal(path, run_dir, holder, "a lock object without a lease (an older version, or not ours)")
            if verdict != "dead":
                lease_s = float(holder["lease_s"])
                if lease_s > _MAX_WAIT_S:
                    raise _refusal(path, run_dir, holder, f"its lease of {lease_s:g} s is too long to wait for")
                if watched is not None and etag != watched:
                    raise _refusal(path, run_dir, holder, "its holder renewed the lease while this process watched")
                if watched is None:
                    watched, since = etag, clock.now()
                left = since + lease_s - clock.now()
                if left > 0:
                    beat = float(holder.get("heartbeat_s") or 1.0)
                    clock.sleep(min(left, max(beat / 2, 0.01)))
                    continue
            # Expired: take it over, on the very version judged (a renewal in between wins).
            gen = holder.get("generation")
            body["generation"] = (gen if isinstance(gen, int) else 0) + 1
            body["took_over"] = {key: holder.get(key) for key in ("owner", "generation", "pid", "host", "pidns")}
            sent = clock.now()
            try:
                res = storage.put(path, json.dumps(body, sort_keys=True).encode(), mode={"e_tag": etag})
            except (AlreadyExistsError, PreconditionError, FileNotFoundError):
                watched = None  # changed under us: judge the new version afresh
                changed += 1
                continue
            return cls._start(storage, run_dir, path, body, res, clock, k.lock_heartbeat_s, sent)
        raise RunDirLockedError("the run lock kept changing hands", path=run_dir)

    @classmethod
    def _start(cls, storage: Any, run_dir: str, path: str, body: dict[str, Any], res: dict[str, Any],
               clock: LeaseClock, heartbeat_s: float, sent: float) -> ObjectLock:
        etag = res.get("e_tag")
        if not etag:
            raise StorageError("the store returned no ETag for the lock object; leases need conditional writes", path=path)
        return cls(storage, run_dir, _Lease(storage, path, body, etag, clock, heartbeat_s, sent))

    # -- holding it --------------------------------------------------------------------
    @property
    def held(self) -> bool:
        return self._finalizer.alive and self._lease.lost is None

    @property
    def token(self) -> str:
        return str(self._lease.body["owner"])

    @property
    def generation(self) -> int:
        return int(self._lease.body["generation"])

    @property
    def renewals(self) -> int:
        """Renewals so far (heartbeats and fences)."""
        return self._lease.renewals

    def fence(self) -> None:
        """Prove this writer still holds the run, right before a commit or deletion: a
        renewal conditional on the lock's ETag (``LeaseLostError`` once taken over).
        From here the lease is in force for ``lock_expiry_s`` on this process's clock."""
        if not self._finalizer.alive:
            raise LeaseLostError("this writer released the run lock; it commits and deletes nothing more",
                                 path=self.path)
        self._lease.renew()

    def stop_heartbeat(self) -> None:
        """Stop renewing without releasing (what a hung or paused holder looks like;
        the lease then expires). Tests and a holder about to block for long use it."""
        self._lease.stop.set()

    def release(self) -> None:
        if not self._finalizer.alive:
            return
        self._finalizer()  # stops the heartbeat
        lease = self._lease
        with lease.mutex:
            etag, lease.etag = lease.etag, None
            if lease.lost is None:
                lease.lost = "this writer released the run lock"
        if etag is None:
            return
        try:
            # Only our own lock: one taken over after our lease expired stays. obstore has
            # no conditional DELETE: a HEAD, then the DELETE (a takeover in between needs
            # our lease to expire in that instant; §O.6).
            if self._s.etag(self.path) == etag:
                self._s.delete([self.path])
        except (StorageError, OSError):
            pass  # unreachable store: the lease expires by itself

    def _drop_in_child(self) -> None:
        # A forked child (DataLoader worker) has no heartbeat thread and must neither
        # renew, commit through, nor delete the parent's lock.
        if self._finalizer.detach() is not None:
            self._lease.lost = "a forked child does not hold its parent's run lock"
            self._lease.etag = None


_held: weakref.WeakSet[ObjectLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_held):
        lock._drop_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _read(storage: Any, path: str) -> tuple[str, dict[str, Any]] | None:
    """(ETag, parsed body) of the lock object, read in one GET; None if it is gone."""
    import obstore
    from obstore.exceptions import BaseError

    key = storage.key(path)
    try:
        res = obstore.get(storage._store, key, options={"range": (0, _MAX_LOCK_BYTES)})
        raw = bytes(res.bytes())
        etag = res.meta.get("e_tag")
    except FileNotFoundError:
        return None
    except BaseError as e:
        raise storage._fail(e, path, "GET") from e
    try:
        holder = json.loads(raw)
    except ValueError:
        holder = {}
    return (etag or "", holder if isinstance(holder, dict) else {})


def _judge(holder: dict[str, Any], me: dict[str, Any], clock: LeaseClock) -> str:
    """``live`` (this very process), ``dead`` (provably), ``unknown`` (no lease), or
    ``lease`` (watch it: only its renewals, or their absence, tell)."""
    if holder.get("v") != _VERSION or not isinstance(holder.get("lease_s"), (int, float)) or holder["lease_s"] < 0:
        return "unknown"
    same_boot = holder.get("host") == me["host"] and holder.get("boot") == me["boot"] and bool(me["boot"])
    if same_boot and me["pidns"] and holder.get("pidns") == me["pidns"] and isinstance(holder.get("pid"), int):
        # One PID namespace: the pid is meaningful here.
        if holder["pid"] == me["pid"]:
            return "live"  # a second writer in this process: refused, as flock refuses it
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return "dead"
        except PermissionError:
            pass
    if same_boot and isinstance(holder.get("expires"), (int, float)) and holder["expires"] < clock.wall():
        return "dead"  # one kernel, one CLOCK_REALTIME: its own expiry has passed
    return "lease"


def _refusal(path: str, run_dir: str, holder: dict[str, Any], why: str) -> RunDirLockedError:
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return RunDirLockedError(
        f"another writer holds this run (pid {holder.get('pid')} on {holder.get('host')}, since {when}"
        + (f", run_id {holder['run_id']}" if holder.get("run_id") else "")
        + f"): {why}; if that process is known dead, delete {path}",
        path=run_dir, holder=holder,
    )
