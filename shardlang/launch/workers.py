"""Local worker processes in one process group: started once, given jobs, results collected.

`shardlang apply --nproc N` runs its one job on such a pool, and the test suite keeps a pool per world
size so that a process group is not spawned per test. A job is a function every rank runs; its
return values come back in rank order. A job that raises on any rank, or a worker that dies, stops
the whole pool within a bounded time and raises WorkerError naming the rank and its traceback: the
other ranks may be waiting in a collective that will never complete, so they are not waited for.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A job failed on a worker (or a worker died)."""

    def __init__(self, rank: int, message: str, details: str = ""):
        super().__init__(f"rank {rank}: {message}")
        self.rank, self.message, self.details = rank, message, details

    def __str__(self) -> str:
        text = f"rank {self.rank}: {self.message}"
        return f"{text}\n{self.details.rstrip()}" if self.details else text


#: Set in a pool worker while a job runs: sends a progress message to the launcher.
_progress = None


def progress(message: str) -> None:
    """Tell the launcher what this rank is doing (shown by rank 0's launcher; ignored elsewhere)."""
    if _progress is not None:
        _progress(message)


def under_torchrun() -> bool:
    """Whether this process is one rank of a job torchrun (or another launcher) started."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, jobs, results, timeout_s: float) -> None:
    if backend == "gloo":
        # A CPU world: hide GPUs so that an `auto` mesh means cpu on every rank, as gloo expects.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: N workers each with a thread per core oversubscribe the CPU, and OpenMP's
        # spinning threads then wait for each other (a 4-worker CPU save ran 2x slower on 2 cores).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001
        results.put((None, rank, "error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    results.put((None, rank, "ready", None, ""))
    while True:
        job = jobs.get()
        if job is None:
            break
        job_id, payload = job
        global _progress
        _progress = lambda message, job_id=job_id: results.put((job_id, rank, "progress", message, ""))  # noqa: E731
        try:
            fn, args, kwargs = pickle.loads(payload)
            value = pickle.dumps(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - report anything, including SystemExit
            results.put((job_id, rank, "error", f"{type(e).__name__}: {e}", traceback.format_exc()))
            continue
        results.put((job_id, rank, "ok", value, ""))
    try:
        destroy_process_groups()
    except Exception:  # noqa: BLE001 - teardown problems after the last job are not the job's
        pass


def destroy_process_groups() -> None:
    """Collect what the jobs left (meshes, sharded modules) and then destroy every process group.

    A gloo group that is still referenced when the interpreter exits is torn down by C++ static
    destructors with its threads still joinable, and the process aborts ("terminate called without
    an active exception"; torch 2.13, about one torchrun exit in two). Collecting first lets most
    groups go while Python is alive (one torchrun exit in ten still aborted, so torchrun workers
    also leave with os._exit: cli.main._exit_now).
    """
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def _fresh(fn, args, results) -> None:
    try:
        results.put(("ok", pickle.dumps(fn(*args))))
    except BaseException as e:  # noqa: BLE001 - any failure goes back to the caller
        try:
            results.put(("error", pickle.dumps(e)))
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            results.put(("error", pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))))


def in_fresh_process(fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0) -> Any:
    """`fn(*args)` in a newly spawned process (no state of this one), its result or its exception."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_fresh, args=(fn, args, results), daemon=True)
    proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                status, payload = results.get(timeout=0.5)
                break
            except queue.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"the process exited with code {proc.exitcode} before returning") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no result within {timeout_s:.0f} s") from None
    finally:
        if proc.is_alive():
            proc.join(5)
        if proc.is_alive():
            proc.kill()
    value = pickle.loads(payload)
    if status == "error":
        raise value
    return value


class WorkerPool:
    """`world_size` processes, each rank of one process group (gloo on CPU, nccl with one GPU each)."""

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        start_timeout_s: float = 120.0,
        on_progress: Callable[[int, str], None] | None = None,
    ):
        self.world_size, self.backend, self.on_progress = world_size, backend, on_progress
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, backend, self._jobs[r], self._results, timeout_s),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._next = 0
        self.broken = False
        self._collect(None, start_timeout_s, "ready")

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0, **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; the return values in rank order."""
        if self.broken:
            raise WorkerError(-1, "the worker pool was stopped by an earlier failure")
        payload = pickle.dumps((fn, args, kwargs))  # fails here, not silently in a queue's feeder thread
        self._next += 1
        for q in self._jobs:
            q.put((self._next, payload))
        return [pickle.loads(v) for v in self._collect(self._next, timeout_s, "ok")]

    def _collect(self, job_id: int | None, timeout_s: float, expect: str) -> list[Any]:
        values: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(values) < self.world_size:
            try:
                got_id, rank, status, value, details = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    self.stop()
                    raise self._died(dead[0]) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(values))
                    self.stop()
                    raise WorkerError(
                        missing[0], f"no result within {timeout_s:.0f} s (ranks {missing} still running)"
                    ) from None
                continue
            if got_id != job_id:
                continue  # a late result of an earlier, failed job
            if status == "progress":
                if self.on_progress is not None:
                    self.on_progress(rank, value)
                continue
            if status == "error":
                raise self._root_cause(WorkerError(rank, value, details))
            values[rank] = value
        return [values[r] for r in range(self.world_size)]

    #: Errors that a rank sees because another one failed, not failures of its own.
    _SYMPTOMS = (
        "Connection closed",
        "Connection reset",
        "Timed out",
        "timed out",
        "Broken pipe",
        "NCCL communicator was aborted",
    )

    def _root_cause(self, first: WorkerError, grace_s: float = 2.0) -> WorkerError:
        """After a rank's error, the error that explains it: a worker that died, or an error that is not
        just a peer's symptom (a closed connection, a timeout). Then stop every worker."""
        errors = [first]
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            dead = [r for r, p in enumerate(self._procs) if p.exitcode not in (None, 0)]
            if dead:
                errors.insert(0, self._died(dead[0]))
                break
            try:
                _, rank, status, value, details = self._results.get(timeout=0.1)
            except queue.Empty:
                continue
            if status == "error":
                errors.append(WorkerError(rank, value, details))
        self.stop()
        causes = [e for e in errors if not any(s in e.message for s in self._SYMPTOMS)]
        return (causes or errors)[0]

    def _died(self, rank: int) -> WorkerError:
        code = self._procs[rank].exitcode
        how = f" (killed by signal {-code})" if code is not None and code < 0 else ""
        return WorkerError(rank, f"worker exited with code {code}{how}")

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop every worker: politely when idle, by force when not done within `grace_s`."""
        self.broken = True
        for q in self._jobs:
            try:
                q.put_nowait(None)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def close(self) -> list[str]:
        """Stop the workers after the last job; warnings for any that exited abnormally while tearing
        down (their results had already arrived, so this does not fail anything)."""
        if self.broken:
            return []
        self.stop(grace_s=30.0)
        return [
            f"rank {r} exited with code {p.exitcode} during teardown, after its results arrived"
            for r, p in enumerate(self._procs)
            if p.exitcode not in (0, None)
        ]

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
