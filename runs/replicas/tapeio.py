"""The seam between a replica rank and the one tape of the run.

Every rank tapes through a sink with the same methods. :class:`LocalSink` calls the
recorder directly (ranks running as threads of the recorder's process: every replay);
:class:`RemoteSink` (a rank in its own process, the recorded run) appends the same calls
to a log that it sends over a pipe to the orchestrator at every step end, and before
it is killed; the orchestrator's :class:`Applier` puts the log on the tape. Decisions are
computed where they happen and travel as values, so the recorder tapes exactly what the
rank decided. A recovery is a ``send`` by the source and a ``recv`` by the joiner; the
receive waits on the tape until its send is there (the two logs come over two pipes).

Why one tape: ``ckpt replay`` re-executes one tape, and its actors' event sequences are
what force mode compares; the log costs one message per step.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import msgpack

from replay import Recorder, Stamp

__all__ = ["Hub", "LocalSink", "RemoteSink", "Applier", "recovery_channel", "roundtrip"]


def recovery_channel(src: str, dst: str) -> str:
    return f"recovery:{src}->{dst}"


class Hub:
    """The recorder, its lock, and the recovery stamps (link key -> send stamp)."""

    def __init__(self, rec: Recorder, *, wait_s: float = 120.0) -> None:
        self.rec = rec
        self.lock = threading.RLock()
        self.wait_s = wait_s
        self._stamps: dict[str, Stamp] = {}
        self._cond = threading.Condition()
        self.listeners: list[Callable[[str, str, tuple], None]] = []  # (actor, method, args) after applying

    def register(self, link: str, stamp: Stamp) -> None:
        with self._cond:
            self._stamps[link] = stamp
            self._cond.notify_all()

    def stamp(self, link: str) -> Stamp:
        with self._cond:
            if not self._cond.wait_for(lambda: link in self._stamps, timeout=self.wait_s):
                raise TimeoutError(f"a recovery was received whose send never reached the tape ({link})")
            return self._stamps[link]

    # one implementation of every sink call, on the recorder
    def apply(self, actor: str, method: str, args: Sequence[Any]) -> Any:
        if method == "recv":
            stamp = self.stamp(str(args[0]))  # outside the lock: the send may still be on its way
            with self.lock:
                out = self.rec.actor(actor).recv(stamp)
        else:
            with self.lock:
                a = self.rec.actor(actor)
                if method == "set_step":
                    a.current_step = int(args[0])
                    out = None
                elif method == "send":
                    channel, peer, digest, link = args
                    out = a.send(channel, peer=peer, digest=bytes(digest))
                    self.register(link, out)
                elif method == "decide":
                    what, key, value = args
                    out = a.decide(what, key, lambda: value)
                elif method == "quorum":
                    key, minimum, members = args
                    out = a.quorum(key, minimum, lambda: members)
                elif method == "inject":
                    fault, target, value = args
                    out = a.maybe_inject(fault, target, lambda: value)
                elif method == "event":
                    out = a.event(args[0], *[bytes(x) if isinstance(x, (bytes, bytearray)) else x for x in args[1:]])
                elif method == "begin_step":
                    out = a.begin_step(int(args[0]))
                elif method == "end_step":
                    out = a.end_step()
                elif method in ("batch", "loss", "note"):
                    out = getattr(a, method)(args[0])
                elif method == "detected":
                    out = a.fault_detected(*args)
                elif method == "record_event":
                    out = a.record_event(int(args[0]), bytes(args[1]))
                elif method == "decide_event":
                    kind, payload = args
                    out = a.decide_event(int(kind), lambda: bytes(payload))
                else:
                    raise ValueError(f"unknown sink call {method!r}")
        for f in self.listeners:
            f(actor, method, tuple(args))
        return out


class _Sink:
    """The calls a rank makes; subclasses route them."""

    name: str

    def _call(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    @property
    def replaying(self) -> bool:
        return False

    @property
    def forced(self) -> bool:
        """Force mode: decisions come from the tape (nothing to agree on with the others)."""
        return False

    def set_step(self, step: int) -> None:
        self._call("set_step", step)

    def begin_step(self, step: int) -> None:
        self._call("begin_step", step)

    def end_step(self) -> None:
        self._call("end_step")

    def batch(self, ids: Sequence[int]) -> None:
        self._call("batch", list(ids))

    def loss(self, value: float) -> None:
        self._call("loss", float(value))

    def note(self, text: str) -> None:
        self._call("note", text)

    def event(self, kind: str, *values: Any) -> None:
        self._call("event", kind, *values)

    def detected(self, fault: str, target: str, detail: Any = None) -> None:
        self._call("detected", fault, target, detail)

    def send(self, channel: str, peer: str, digest: bytes, link: str) -> None:
        self._call("send", channel, peer, digest, link)

    def recv(self, link: str) -> None:
        self._call("recv", link)

    def record_event(self, kind: int, payload: bytes) -> None:
        """An event a library encodes (the loss-spike guard's kinds)."""
        self._call("record_event", int(kind), bytes(payload))

    def decide(self, what: str, key: str, compute: Callable[[], Any]) -> Any:
        raise NotImplementedError

    def decide_event(self, kind: int, compute: Callable[[], bytes]) -> bytes:
        raise NotImplementedError

    def quorum(self, key: str, minimum: int, members: Callable[[], Sequence[str]]) -> list[str]:
        raise NotImplementedError

    def inject(self, fault: str, target: str, compute: Callable[[], Any]) -> Any:
        raise NotImplementedError

    def flush(self, *, final: bool = False, dying: bool = False, up: bool = False, result: Any = None) -> None:
        pass


class LocalSink(_Sink):
    """A rank in the recorder's process (every replay): force mode answers the decisions."""

    def __init__(self, hub: Hub, name: str) -> None:
        self.hub = hub
        self.name = name

    @property
    def replaying(self) -> bool:
        return self.hub.rec.replaying

    def _call(self, method: str, *args: Any) -> Any:
        return self.hub.apply(self.name, method, args)

    def decide(self, what: str, key: str, compute: Callable[[], Any]) -> Any:
        with self.hub.lock:
            return self.hub.rec.actor(self.name).decide(what, key, compute)

    def quorum(self, key: str, minimum: int, members: Callable[[], Sequence[str]]) -> list[str]:
        with self.hub.lock:
            return self.hub.rec.actor(self.name).quorum(key, minimum, members)

    def inject(self, fault: str, target: str, compute: Callable[[], Any]) -> Any:
        with self.hub.lock:
            return self.hub.rec.actor(self.name).maybe_inject(fault, target, compute)

    @property
    def forced(self) -> bool:
        return self.hub.rec.mode == "force"

    def decide_event(self, kind: int, compute: Callable[[], bytes]) -> bytes:
        # computed outside the lock (it loads a checkpoint and talks to the other replicas)
        payload = None if self.forced else bytes(compute())
        with self.hub.lock:
            return self.hub.rec.actor(self.name).decide_event(int(kind), lambda: payload)


def roundtrip(v: Any) -> Any:
    # what force mode would return: the msgpack image (tuples become lists)
    return msgpack.unpackb(msgpack.packb(v, use_bin_type=True), raw=False)


class RemoteSink(_Sink):
    """A rank in its own process: calls are logged and sent to the orchestrator."""

    def __init__(self, conn: Any, name: str) -> None:
        self.conn = conn
        self.name = name
        self._log: list[list[Any]] = []
        self._lock = threading.Lock()  # torchft's quorum thread tapes the quorum and recoveries

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            self._log.append([method, *args])

    def decide(self, what: str, key: str, compute: Callable[[], Any]) -> Any:
        v = roundtrip(compute())
        self._call("decide", what, key, v)
        return v

    def quorum(self, key: str, minimum: int, members: Callable[[], Sequence[str]]) -> list[str]:
        m = [str(x) for x in members()]
        self._call("quorum", key, minimum, m)
        return m

    def inject(self, fault: str, target: str, compute: Callable[[], Any]) -> Any:
        v = roundtrip(compute())
        self._call("inject", fault, target, v)
        return v

    def decide_event(self, kind: int, compute: Callable[[], bytes]) -> bytes:
        payload = bytes(compute())
        self._call("decide_event", int(kind), payload)
        return payload

    def flush(self, *, final: bool = False, dying: bool = False, up: bool = False, result: Any = None) -> None:
        """Send the log so far; ``up``: this rank's torchft manager is running (heartbeating)."""
        with self._lock:
            log, self._log = self._log, []
            self.conn.send_bytes(msgpack.packb({"actor": self.name, "log": log, "final": final, "dying": dying,
                                                "up": up, "result": result}, use_bin_type=True))


class Applier:
    """Orchestrator side: one thread per rank pipe puts its logs on the tape, in order."""

    def __init__(self, hub: Hub, on_message: Callable[[str, dict], None] | None = None) -> None:
        self.hub = hub
        self.on_message = on_message
        self.errors: list[BaseException] = []
        self._threads: list[threading.Thread] = []

    def attach(self, name: str, conn: Any) -> None:
        t = threading.Thread(target=self._pump, args=(name, conn), name=f"applier-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def _pump(self, name: str, conn: Any) -> None:
        try:
            while True:
                try:
                    raw = conn.recv_bytes()
                except (EOFError, OSError):
                    return  # the rank exited (or was killed after its last flush)
                msg = msgpack.unpackb(raw, raw=False)
                for entry in msg["log"]:
                    self.hub.apply(msg["actor"], entry[0], entry[1:])
                if self.on_message is not None:
                    self.on_message(name, msg)
                if msg["final"]:
                    return
        except BaseException as e:  # reported by the orchestrator
            self.errors.append(e)
            if self.on_message is not None:
                self.on_message(name, {"actor": name, "log": [], "final": True, "dying": False, "error": repr(e)})

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)
