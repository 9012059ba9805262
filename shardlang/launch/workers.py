"""Local worker processes in one process group: started once, given jobs, results collected.

`shardlang apply --nproc N` runs its one job on such a pool, and the test suite keeps a pool per world
size so that a process group is not spawned per test. A job is a function every rank runs; its
return values come back in rank order. A job that raises on any rank, or a worker that dies, stops
the whole pool within a bounded time and raises WorkerError naming the rank and its traceback: the
other ranks may be waiting in a collective that will never complete, so they are not waited for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import signal
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

from ..runtime.lifetime import die_with
from .failures import WorkerError, failure_of, worker_error
from .servers import context, deathsig, sigint_ignored

#: Set in a pool worker while a job runs: sends a progress message to the launcher.
_progress = None
#: What this rank last said it was doing (for a failure's report where no launcher listens: torchrun).
_said = "starting"


class Message(NamedTuple):
    """One message a worker puts on the results queue: of which job (None: start-up), from which rank, its
    status (`ready`, `progress`, `ok`, `error`) and its value (a progress message, a pickled result, a
    failure as failure_of describes it)."""

    job: int | None
    rank: int
    status: str
    value: Any


def progress(message: str) -> None:
    """Tell the launcher what this rank is doing (shown by rank 0's launcher; ignored elsewhere)."""
    global _said
    _said = message
    if _progress is not None:
        _progress(message)


def under_torchrun() -> bool:
    """Whether this process is one rank of a job torchrun (or another launcher) started."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    jobs,
    results,
    timeout_s: float,
    env: dict[str, str],
    said,
    log: str | None = None,
    deathsig: bool = True,
) -> None:
    # Ctrl-C is the launcher's to handle (it stops every worker): a worker prints no KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with(None, deathsig)
    _take_environment(env)
    if log is not None:
        # What torch and gloo print (C++ warnings, logged tracebacks, teardown notices) goes to a file: the
        # launcher reports failures itself, and shows these logs with --debug.
        # Its stdout too (a model file's print): with --json the launcher's stdout is the report alone.
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
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
    if "OMP_NUM_THREADS" in os.environ:
        # Read by OpenMP when torch was loaded, which in a forkserver's child was before this environment
        with contextlib.suppress(ValueError):
            torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    else:
        # As torchrun does: N workers each with a thread per core oversubscribe the CPU, and OpenMP's
        # spinning threads then wait for each other (a 4-worker CPU save ran 2x slower on 2 cores).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001
        results.put(Message(None, rank, "error", failure_of(e)))
        return
    results.put(Message(None, rank, "ready", None))
    while True:
        job = jobs.get()
        if job is None:
            break
        job_id, payload = job
        global _progress

        def _progress(message: str, job_id=job_id) -> None:
            # Written where the launcher reads it at once, then queued (the queue's feeder thread may not
            # send it before a SIGKILL that comes next: the shared bytes are there already).
            said.value = message.encode("utf-8", "replace")[: len(said) - 1]
            results.put(Message(job_id, rank, "progress", message))

        try:
            fn, args, kwargs = pickle.loads(payload)
            value = pickle.dumps(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - report anything, including SystemExit
            results.put(Message(job_id, rank, "error", failure_of(e)))
            continue
        results.put(Message(job_id, rank, "ok", value))
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
    also leave with os._exit: cli.signals.exit_now).
    """
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def _fresh(fn, args, results, env: dict[str, str], deathsig: bool = True) -> None:
    die_with(None, deathsig)
    _take_environment(env)
    try:
        results.put(("ok", pickle.dumps(fn(*args))))
    except BaseException as e:  # noqa: BLE001 - any failure goes back to the caller
        try:
            results.put(("error", pickle.dumps(e)))
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            results.put(("error", pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))))


def in_fresh_process(fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0) -> Any:
    """`fn(*args)` in a new process (no state of this one: see `context`), its result or its exception."""
    ctx = context()
    results = ctx.Queue()
    proc = ctx.Process(target=_fresh, args=(fn, args, results, dict(os.environ), deathsig(ctx)), daemon=True)
    proc.start()
    deadline, returned = time.monotonic() + timeout_s, False
    try:
        while True:
            try:
                status, payload = results.get(timeout=0.5)
                returned = True
                break
            except queue.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"the process exited with code {proc.exitcode} before returning") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no result within {timeout_s:.0f} s") from None
    finally:
        # After its result, it gets a moment to exit; on a timeout, an error or an interrupt here (explain's
        # --timeout, Ctrl-C), it is killed at once: nothing is left running once this returns or raises.
        if returned:
            proc.join(5)
        if proc.is_alive():
            proc.kill()
        proc.join(5)
    value = pickle.loads(payload)
    if status == "error":
        raise value
    return value


def _take_environment(env: dict[str, str]) -> None:
    """The environment of the process that asked for this one (a forkserver's child has the forkserver's)."""
    if dict(os.environ) != env:
        os.environ.clear()
        os.environ.update(env)


def _tell_ranks(error: BaseException, ranks: list[dict[str, Any]]) -> None:
    """What every rank last said, on an exception that stops the pool (a WorkerError, or Ctrl-C or a
    forwarded SIGTERM arriving while it waits): `error.ranks`, for a report printed on the way out."""
    if not getattr(error, "ranks", None):
        with contextlib.suppress(AttributeError, TypeError):
            error.ranks = ranks


def error_of(rank: int, error: BaseException) -> WorkerError:
    """This process's own failure as the launcher would report a worker's (a rank under torchrun, where
    no launcher collects the ranks: it can say only what it did itself)."""
    failure = failure_of(error)
    found = worker_error(rank, failure)
    found.ranks = [{"rank": rank, "said": _said, "state": "raised", "error": failure["message"]}]
    return found


class WorkerPool:
    """`world_size` processes, each rank of one process group (gloo on CPU, nccl with one GPU each)."""

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        start_timeout_s: float | None = None,
        on_progress: Callable[[int, str], None] | None = None,
        log_dir: str | None = None,
    ):
        """Start the workers and wait until every one has joined the process group: up to `start_timeout_s`
        (default `timeout_s`, which also bounds each collective); on a loaded machine starting N Python
        processes that import torch takes minutes. With `log_dir`, each rank's stderr goes to
        `log_dir/rank<R>.log` (see `logs`) instead of this process's stderr."""
        self.world_size, self.backend, self.on_progress = world_size, backend, on_progress
        self.start_timeout_s = timeout_s if start_timeout_s is None else start_timeout_s
        self.log_dir = log_dir
        ctx = context()
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._doing = ["starting"] * world_size  # each rank's last progress message, for a rank that dies
        # The same, in shared memory: read when a rank dies, whatever its queue had not yet sent.
        self._said = [ctx.Array("c", 240, lock=False) for _ in range(world_size)]
        self._ended: dict[int, dict[str, Any]] = {}  # how each rank's current job ended, where it did
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    world_size,
                    port,
                    backend,
                    self._jobs[r],
                    self._results,
                    timeout_s,
                    dict(os.environ),
                    self._said[r],
                    None if log_dir is None else str(Path(log_dir) / f"rank{r}.log"),
                    deathsig(ctx),
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        self._next = 0
        self.broken = False
        try:
            deadline = time.monotonic() + self.start_timeout_s
            with sigint_ignored():  # inherited through exec: a worker never sees the terminal's Ctrl-C
                for proc in self._procs:
                    proc.start()  # a forkserver's first child waits for its imports: part of the start-up time
            self._collect(None, deadline, self.start_timeout_s)
        except BaseException as e:
            self.kill()
            _tell_ranks(e, self.ranks())
            raise

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0, **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; the return values in rank order."""
        if self.broken:
            raise WorkerError(-1, "the worker pool was stopped by an earlier failure")
        payload = pickle.dumps((fn, args, kwargs))  # fails here, not silently in a queue's feeder thread
        self._next += 1
        self._doing = ["running its job"] * self.world_size
        for said in self._said:
            said.value = b""
        self._ended = {}
        try:
            for q in self._jobs:
                q.put((self._next, payload))
            values = self._collect(self._next, time.monotonic() + timeout_s, timeout_s)
        except WorkerError:
            raise
        except BaseException as e:  # Ctrl-C, a forwarded SIGTERM: stop every worker now, not after the job
            self.kill()
            _tell_ranks(e, self.ranks())
            raise
        return [pickle.loads(v) for v in values]

    def _collect(self, job_id: int | None, deadline: float, timeout_s: float) -> list[Any]:
        """Every rank's result of job `job_id` (None: start-up) by `deadline` (a `time.monotonic()`), which
        is `timeout_s` after the job (or the start) began."""
        try:
            return self._gather(job_id, deadline, timeout_s)
        except WorkerError as e:
            e.ranks = self.ranks()
            if job_id is None and e.kind == "raised":
                e.kind = "startup"  # a rank that could not join the process group
            raise

    def ranks(self) -> list[dict[str, Any]]:
        """What each rank said in the current job (or start-up): its last progress message, and how it ended
        where it did: `done` (`ready` at start-up), `raised` (with its error), `died` (with its exit code);
        else `running`, or `starting` for a rank that has not joined. For a report that must say what every rank was doing."""
        return [
            {
                "rank": r,
                "said": self._doing[r],
                **self._ended.get(r, {"state": "starting" if self._doing[r] == "starting" else "running"}),
            }
            for r in range(self.world_size)
        ]

    def _gather(self, job_id: int | None, deadline: float, timeout_s: float) -> list[Any]:
        values: dict[int, Any] = {}
        while len(values) < self.world_size:
            try:
                got = self._results.get(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    self._drain(job_id)
                    self.stop()
                    raise self._died(dead[0]) from None
                if time.monotonic() >= deadline:
                    missing = sorted(set(range(self.world_size)) - set(values))
                    self.kill()  # stuck workers read no polite stop
                    raise self._late(job_id, timeout_s, missing) from None
                continue
            if got.job != job_id:
                continue  # a late result of an earlier, failed job
            if got.status == "progress":
                self._doing[got.rank] = got.value
                if self.on_progress is not None:
                    self.on_progress(got.rank, got.value)
                continue
            if got.status == "error":
                self._ended[got.rank] = {"state": "raised", "error": got.value["message"]}
                raise self._root_cause(worker_error(got.rank, got.value))
            values[got.rank] = got.value
            self._ended[got.rank] = {"state": "done" if job_id is not None else "ready"}
            if job_id is None:
                self._doing[got.rank] = "ready"
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
        just a peer's symptom (a closed connection, a timeout); waits until every rank has answered, for at
        most `grace_s`. Then stop every worker."""
        errors, answered = [first], {first.rank}
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and len(answered) < self.world_size:
            dead = [r for r, p in enumerate(self._procs) if p.exitcode not in (None, 0)]
            if dead:
                errors.insert(0, self._died(dead[0]))
                break
            try:
                got = self._results.get(timeout=0.1)
            except queue.Empty:
                continue
            if got.status in ("ok", "error"):
                answered.add(got.rank)
            if got.status == "error":
                self._ended[got.rank] = {"state": "raised", "error": got.value["message"]}
                errors.append(worker_error(got.rank, got.value))
        self.stop()
        if errors[0].died:
            return errors[0]
        causes = [e for e in errors if not any(s in e.message for s in self._SYMPTOMS)]
        return min(causes or errors, key=lambda e: e.rank)  # the same error on every rank: rank 0's

    def _drain(self, job_id: int | None) -> None:
        """Take in the progress messages still queued (what a rank that died was doing)."""
        with contextlib.suppress(queue.Empty, OSError, EOFError):
            while True:
                got = self._results.get_nowait()
                if got.job == job_id and got.status == "progress":
                    self._doing[got.rank] = got.value

    def _died(self, rank: int) -> WorkerError:
        code = self._procs[rank].exitcode
        said = self._said[rank].value.decode("utf-8", "replace")
        if said:
            self._doing[rank] = said
        how = f" (killed by signal {-code})" if code is not None and code < 0 else ""
        self._ended[rank] = {"state": "died", "exit_code": code}
        return WorkerError(rank, f"worker exited with code {code}{how} (last reported: {self._doing[rank]})", died=True)

    def _late(self, job_id: int | None, timeout_s: float, missing: list[int]) -> WorkerError:
        ranks = ", ".join(map(str, missing))
        if job_id is None:
            return WorkerError(
                missing[0],
                f"start-up timed out: rank{'s' if len(missing) > 1 else ''} {ranks} of {self.world_size} did not "
                f"report ready within {timeout_s:g} s",
                kind="startup",
                summary=f"start-up timed out after {timeout_s:g} s: rank{'s' if len(missing) > 1 else ''} {ranks} "
                f"of {self.world_size} never reported (a loaded machine may need a longer --timeout)",
            )
        doing = "; ".join(f"rank {r}: {self._doing[r]}" for r in missing[:4])
        return WorkerError(
            missing[0],
            f"no result within {timeout_s:g} s (ranks {missing} still running)",
            kind="timeout",
            summary=f"timed out after {timeout_s:g} s: rank{'s' if len(missing) > 1 else ''} {ranks} still "
            f"running ({doing})",
        )

    def logs(self) -> dict[int, str]:
        """Each rank's stderr so far, where the pool was given a `log_dir` (rank -> text; empty ones left out)."""
        found = {}
        for r in range(self.world_size if self.log_dir else 0):
            path = Path(self.log_dir) / f"rank{r}.log"
            text = path.read_text(errors="replace") if path.exists() else ""
            if text.strip():
                found[r] = text
        return found

    def kill(self) -> None:
        """Stop every worker at once (an interrupt, or a failed start): SIGKILL, so none prints anything."""
        self.broken = True
        for proc in self._procs:
            if proc.pid is not None and proc.is_alive():
                with contextlib.suppress(OSError):
                    proc.kill()
        for proc in self._procs:
            if proc.pid is not None:
                proc.join(5)

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

    @property
    def pids(self) -> list[int | None]:
        """The workers' process ids, in rank order."""
        return [proc.pid for proc in self._procs]

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
