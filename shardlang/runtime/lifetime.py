"""Child processes that do not outlive the process that started them, however it ends."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time


def die_with(parent: int | None = None, deathsig: bool = True) -> None:
    """End this child when the process that started it dies, whatever killed it (SIGTERM, the OOM killer's
    SIGKILL): the kernel's parent-death signal on Linux, and a thread watching the parent everywhere (for
    other systems, and for the moment before prctl took effect).

    `parent` is the pid of a parent that forked this child itself. Without it, this is a multiprocessing
    child, spawned or forked by a forkserver, and the process that asked for it is watched through
    multiprocessing's parent sentinel (a pipe that process holds open while it lives): a forkserver's child
    has the forkserver as its parent, which outlives the launcher while any child is left.

    The kernel sends its signal when the parent *thread* that started the child ends, so `deathsig` is off
    for a child started from a thread other than the main one (a pool's workers outlive such a thread),
    and only the watcher acts."""
    if deathsig and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if parent is None:
        from multiprocessing import parent_process
        from multiprocessing.connection import wait

        sentinel = parent_process().sentinel
        if wait([sentinel], timeout=0):
            os._exit(1)  # the launcher died before this child got here

        def watch() -> None:
            wait([sentinel])
            os._exit(1)

    else:
        if os.getppid() != parent:
            os._exit(1)  # the parent died before prctl

        def watch() -> None:
            while True:
                time.sleep(0.5)
                if os.getppid() != parent:
                    os._exit(1)

    threading.Thread(target=watch, name="shardlang-parent-watch", daemon=True).start()


def kill_and_reap(pid: int) -> None:
    """SIGKILL a child of this process (if it is still there) and wait for it: nothing left running, no zombie."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
