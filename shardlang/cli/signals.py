"""Signals a command runs under: SIGTERM and SIGHUP stop its workers, SIGALRM bounds user code, and a
torchrun worker leaves without C++ static destructors."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn

from .status import UsageError


class Terminated(BaseException):
    """The launcher got SIGTERM (a scheduler, `kill`): raised where it runs, so the workers are stopped."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum, self.name = signum, signal.Signals(signum).name


@contextlib.contextmanager
def terminable() -> Iterator[None]:
    """SIGTERM (and SIGHUP) raise Terminated in the main thread while workers run, as SIGINT raises
    KeyboardInterrupt: the pool kills its workers on the way out, and main prints one line."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Terminated(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _TimedOut(BaseException):
    """Raised by time_limit's alarm inside user code (a BaseException, so that no `except Exception` eats it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str) -> Iterator[None]:
    """Bound `what` (a model file's import, build_model, explain's simulated step) by `seconds`: a usage
    error when it runs longer. A SIGALRM timer, so only in the main thread (elsewhere: unbounded)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        if importing_torch(frame):  # cut short, torch stays half-imported for the rest of the process
            signal.setitimer(signal.ITIMER_REAL, IMPORT_GRACE_S)
            return
        raise _TimedOut

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _TimedOut:
        raise UsageError(f"{what} took longer than --timeout {seconds:g} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


#: How long an alarm that finds torch importing waits before it looks again.
IMPORT_GRACE_S = 0.05


def importing_torch(frame) -> bool:
    """Whether `frame`'s thread is importing a module of torch (a frame of importlib's `_find_and_load` for
    it). An alarm raised there leaves that module's submodules in sys.modules but not on their package,
    so every later use of them in this process fails ("module 'torch.distributed.tensor' has no attribute
    '_dtensor_spec'"): lint carries on after its traced forward runs out of time, and its step met that."""
    while frame is not None:
        if frame.f_code.co_name == "_find_and_load" and str(frame.f_locals.get("name", "")).startswith("torch"):
            return True
        frame = frame.f_back
    return False


def exit_now(status: int) -> NoReturn:
    """End a torchrun worker without running C++ static destructors.

    Even after a collection, something can keep a gloo group alive until interpreter exit, where
    its destructor aborts the process with its threads still joinable
    (torch 2.13: "terminate called without an active exception", so torchrun reports a failure
    after a job that passed). The report is printed and the groups destroyed; flush and leave.
    """
    import logging

    logging.shutdown()  # what atexit would have done for log files the model file opened
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
