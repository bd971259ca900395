"""The backend's futures and their completer thread, called directly: a callback registered on a
finished future runs on the completer thread, in order, and an error reaches the chained future.
test_backend.py runs them under torch.distributed. No communication.
"""
from __future__ import annotations

import threading

import pytest

from hpcdl.torch_distributed.work import Completer, Future, in_callback


def test_callbacks_run_on_the_completer_thread_in_order() -> None:
    completer = Completer("probe completer")
    try:
        future = Future(completer)
        seen: list[tuple[str, bool, str]] = []
        done = threading.Event()
        doubled = future.then(lambda f: f.value() * 2)
        future.add_done_callback(lambda f: seen.append(("early", in_callback(), threading.current_thread().name)))
        assert not in_callback() and seen == []  # not finished: nothing ran
        future._finish(21)
        assert doubled.wait() == 42 and [s[0] for s in seen] == ["early"]  # ran where it finished
        future.add_done_callback(lambda f: (seen.append(("late", in_callback(), threading.current_thread().name)),
                                            done.set()))
        assert done.wait(10)
        assert seen[1] == ("late", True, "probe completer")
    finally:
        completer.stop(timeout=10)


def test_an_error_in_a_callback_reaches_the_chained_future() -> None:
    completer = Completer("probe completer")
    try:
        future = Future(completer)
        failed = future.then(lambda f: 1 / 0)
        future._finish(None)
        with pytest.raises(ZeroDivisionError):
            failed.wait()
    finally:
        completer.stop(timeout=10)
