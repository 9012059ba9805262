"""The processes multiprocessing starts for the workers: the forkserver every worker and fresh process is
forked from (preloaded with torch and shardlang, started early so its imports overlap the launcher's own
work), how a child takes the parent-death signal and the launcher's Ctrl-C, and how a command stops it all
before it exits."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch.multiprocessing as mp

#: What a forkserver imports once for every process it forks: torch and the modules a worker's job and a
#: fresh explain run. A spawned process imports them itself, seconds of CPU each (most of a small job's
#: time on a loaded machine, and most of the test suite's).
PRELOAD = ("torch", "torch.distributed", "shardlang.launch.job", "shardlang.explain.simulate")

_starting = threading.Lock()


def context():
    """The multiprocessing context workers and fresh processes start from: a forkserver preloaded with
    `PRELOAD` where the platform has one (Linux, macOS), else spawn. A forkserver's child is a fork of a
    process that has imported those modules and done nothing else (no CUDA, no process group, no thread):
    as clean as a spawned one, without the imports. It takes its working directory and `sys.path` from
    the process that asked for it (multiprocessing sends them), and its environment from the arguments
    (`_take_environment`): the forkserver's is the one it was started with."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    start_forkserver()
    return ctx


def start_forkserver(also: tuple[str, ...] = (), quiet: bool = False) -> None:
    """Start the forkserver now, if it is not running, so that its imports overlap whatever this process
    does next (its first child waits for them). It finds this copy of shardlang first on its path: it is
    started as `python -c`, and the path of the process asking (a test's, a script's) is not passed to it.

    `also`: more modules for it to import (a model file's library); transformers where this process has
    imported it. `quiet`: it, and so every child, gets /dev/null for stdout and stderr instead of this
    process's, for a launcher whose workers write to log files: a server still importing when such a
    launcher exits early then holds no pipe that a caller reads to its end. Only while this process runs
    no other thread that writes to them."""
    import multiprocessing.forkserver as forkserver

    if "forkserver" not in mp.get_all_start_methods():
        return
    extra = [*also, *(["transformers"] if "transformers" in sys.modules else [])]
    with _starting:
        forkserver.set_forkserver_preload(list(dict.fromkeys([*PRELOAD, *extra])))
        root = str(Path(__file__).resolve().parents[2])
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([root, saved] if saved else [root])
        try:
            # SIGINT ignored is inherited through exec, and by every child: Ctrl-C is the launcher's
            with sigint_ignored(), _stdio_to_null(quiet):
                forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved


def stop_servers() -> None:
    """Stop the processes multiprocessing started for this one, and wait until they are gone: for a command
    about to exit, so that nothing it started outlives it. The forkserver is killed: left to itself, an
    orphaned server tears its interpreter (torch, transformers) down for seconds after its parent is gone,
    and it holds no device, file or state of ours; any worker of its still alive dies with it (the
    parent-death signal each takes, `die_with`). Then the resource tracker is asked to stop (it frees what
    a killed worker left behind) and waited for. Both through multiprocessing's own `_stop`, which stops,
    reaps and cleans up after them (Python 3.10-3.13)."""
    import multiprocessing.forkserver as forkserver
    import multiprocessing.resource_tracker as resource_tracker

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for running in (server, getattr(resource_tracker, "_resource_tracker", None)):
        stop = getattr(running, "_stop", None)
        if stop is not None:
            with contextlib.suppress(OSError, ChildProcessError):
                stop()


@contextlib.contextmanager
def _stdio_to_null(on: bool) -> Iterator[None]:
    """File descriptors 1 and 2 on /dev/null for the block (what a process started in it inherits)."""
    if not on:
        yield
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (null, *saved):
            os.close(fd)


def deathsig(ctx) -> bool:
    """Whether a child of `ctx` may take the kernel's parent-death signal (see die_with): a forkserver's
    children are forked by its main thread; a spawned one by this thread, which must be the main one."""
    return ctx.get_start_method() == "forkserver" or threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while workers are started: an ignored signal stays ignored across exec, and Python
    then installs no KeyboardInterrupt handler, so the terminal's Ctrl-C reaches the launcher only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
