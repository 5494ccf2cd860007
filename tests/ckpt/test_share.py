"""``ckpt._helpers.share``: the caller and one helper take calls in turn (the hash and the
copy passes of a verified in-place load, issue 27 item 3). What it must hold whatever the
scheduler does: every call runs once, the caller never waits for a helper that has not
started, it does wait for the call the helper is running, and the error raised is the one
running the calls in order would raise first."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest

from ckpt import _helpers
from tests import hangs

#: an event wait that takes microseconds on a quiet machine: past this, a hang
BOUND_S = hangs.hang_s(0.01)


class _Boom(Exception):
    pass


def _recording(n: int, fail: frozenset[int] = frozenset()) -> tuple[list[Callable[[], None]], list[tuple[int, int]]]:
    """``n`` calls that record (index, thread id); those in ``fail`` raise after recording."""
    ran: list[tuple[int, int]] = []

    def call(i: int) -> None:
        ran.append((i, threading.get_ident()))
        if i in fail:
            raise _Boom(i)

    return [lambda i=i: call(i) for i in range(n)], ran


def test_every_call_runs_exactly_once() -> None:
    for n in (0, 1, 2, 3, 64):
        calls, ran = _recording(n)
        _helpers.share(calls)
        assert sorted(i for i, _ in ran) == list(range(n))


def _deferred_helper(monkeypatch: pytest.MonkeyPatch) -> list[Callable[[], Any]]:
    """A helper the scheduler never runs while ``share`` is in progress: the call handed
    to it is kept, to be run by the test afterwards."""
    parked: list[Callable[[], Any]] = []

    def run(fn: Callable[..., Any], *args: Any) -> _helpers.Pending:
        parked.append(lambda: fn(*args))
        return _helpers.Pending()

    monkeypatch.setattr(_helpers, "run", run)
    return parked


def test_a_helper_that_never_starts_is_not_waited_for_and_starts_nothing_later(monkeypatch: pytest.MonkeyPatch) -> None:
    parked = _deferred_helper(monkeypatch)
    calls, ran = _recording(10)
    _helpers.share(calls)  # returns: nothing waits for the parked helper
    me = threading.get_ident()
    assert ran == [(i, me) for i in range(10)]
    assert len(parked) == 1
    parked[0]()  # the helper runs at last: it finds the share closed
    assert len(ran) == 10


def _helper_inside_first_call(monkeypatch: pytest.MonkeyPatch, inside: threading.Event) -> None:
    """The helper starts at once and holds call 0 before the caller takes any."""

    def run(fn: Callable[..., Any], *args: Any) -> _helpers.Pending:
        threading.Thread(target=fn, args=args, daemon=True).start()
        assert inside.wait(BOUND_S)
        return _helpers.Pending()

    monkeypatch.setattr(_helpers, "run", run)


def _held_call(monkeypatch: pytest.MonkeyPatch, done: list[str]) -> tuple[Callable[[], None], threading.Event]:
    """Call 0, which the helper starts at once (before the caller takes any) and finishes
    only once the returned event is set; it then records "helper's call" in ``done``."""
    inside, release = threading.Event(), threading.Event()

    def helpers_call() -> None:
        inside.set()
        assert release.wait(BOUND_S)
        done.append("helper's call")

    _helper_inside_first_call(monkeypatch, inside)
    return helpers_call, release


def test_the_caller_waits_for_the_call_the_helper_is_running(monkeypatch: pytest.MonkeyPatch) -> None:
    done: list[str] = []
    helpers_call, release = _held_call(monkeypatch, done)

    def callers_call() -> None:
        done.append("caller's call")
        release.set()  # the helper's call finishes only now: share must wait for it

    _helpers.share([helpers_call, callers_call])
    assert done == ["caller's call", "helper's call"]


def test_the_error_raised_is_the_first_failed_calls_and_nothing_starts_after_it() -> None:
    for _ in range(20):  # whichever thread runs which call
        calls, ran = _recording(40, fail=frozenset({7, 23}))
        with pytest.raises(_Boom) as e:
            _helpers.share(calls)
        assert e.value.args == (7,)
        assert sorted(i for i, _ in ran)[:8] == list(range(8))  # every call before the failed one ran


def test_without_a_helper_the_calls_after_a_failure_never_start(monkeypatch: pytest.MonkeyPatch) -> None:
    _deferred_helper(monkeypatch)
    calls, ran = _recording(10, fail=frozenset({3}))
    with pytest.raises(_Boom):
        _helpers.share(calls)
    assert [i for i, _ in ran] == [0, 1, 2, 3]


def test_an_interrupt_in_the_caller_still_waits_for_the_helpers_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt in the caller's call must not return while the helper still runs
    a call: it may be copying out of a mapping the caller then unmaps."""
    done: list[str] = []
    helpers_call, release = _held_call(monkeypatch, done)

    def interrupted() -> None:
        release.set()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _helpers.share([helpers_call, interrupted])
    assert done == ["helper's call"]
