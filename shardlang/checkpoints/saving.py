"""Saving a checkpoint so that nothing is lost on failure: staged beside its place, published in one step
once every rank has written its part, one save at a time per directory.

Nothing is lost on failure: a save writes into a hidden sibling directory and, once every rank has
finished, rank 0 swaps it into place in one rename, so an interrupted save leaves the previous
checkpoint whole.

One save at a time per directory: a save holds an flock on `.NAME.lock` beside it (the kernel releases
it when the process dies, so a killed save leaves no stale lock).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import socket
import stat
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from .._version import __version__
from ..frontend.diagnostics import SL501, PlanError
from .common import first_line, plan_error, process_group_up
from .records import INFO_FILE, Checkpoint, Transfer, checkpoint_contents
from .state import model_state_dict

try:
    import fcntl
except ImportError:  # not POSIX: saves are not locked against each other
    fcntl = None  # type: ignore[assignment]


def save_checkpoint(
    model: torch.nn.Module,
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    info: Mapping[str, Any] | None = None,
) -> Transfer:
    """Write `model`'s (and `optimizer`'s) state to `path` as a DCP checkpoint, replacing the one there
    only once every rank has written all of its part.

    Call it on every rank (or in one process, for an unsharded model). `path` must not be an existing
    directory that is not a checkpoint (SL501: it is never overwritten). `info` is added to
    shardlang.json."""
    start = time.perf_counter()
    state: dict[str, Any] = {"model": model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    written = write_checkpoint(
        state,
        Path(path),
        {"optimizer": type(optimizer).__name__ if optimizer is not None else None, **(info or {})},
        distributed=process_group_up(),
    )
    return Transfer(str(path), written.tensors, written.bytes, time.perf_counter() - start, optimizer is not None)


def write_checkpoint(state: dict[str, Any], path: Path, info: Mapping[str, Any], *, distributed: bool) -> Checkpoint:
    """Save `state` as a DCP checkpoint at `path` (see `write_staged`), with shardlang.json beside it."""
    world = dist.get_world_size() if distributed else 1

    def write(staging: Path) -> Metadata:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            metadata = dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staging)), no_dist=not distributed)
        if not distributed or dist.get_rank() == 0:
            _write_json(
                staging / INFO_FILE,
                {
                    "format": 1,
                    "shardlang": __version__,
                    "torch": torch.__version__,
                    "world_size": world,
                    "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    **info,
                },
            )
        return metadata

    metadata, target = write_staged(path, write, distributed=distributed)
    return checkpoint_contents(target, metadata, info)


def write_staged(
    path: Path,
    write: Callable[[Path], Any],
    *,
    distributed: bool,
    unreplaceable: Callable[[Path], str | None] | None = None,
) -> tuple[Any, Path]:
    """Run `write(staging)` on every rank into a hidden sibling of `path`, then publish it there once every
    rank is done; what rank 0's `write` returned (every rank's own, elsewhere) and the directory replaced.

    Rank 0 holds the save lock from before the staging directory exists until the new checkpoint is in
    place, so no other save removes it as a leftover. A failed save, on any rank, is SL501 on every rank
    and leaves what was at `path` as it was. `unreplaceable(target)` says why a directory must not be
    replaced (default: anything but a DCP checkpoint)."""
    rank0 = not distributed or dist.get_rank() == 0
    many = distributed and dist.get_world_size() > 1
    with contextlib.ExitStack() as held:
        problem, staging, target = None, None, None
        if rank0:
            try:
                target = _save_target(path, unreplaceable or _unreplaceable)
                held.enter_context(_save_lock(target, path))
                staging = target.parent / f".{target.name}.saving-{uuid.uuid4().hex[:12]}"
            except PlanError as e:
                problem = e.diagnostics[0]
        if many:
            shared = [problem, staging, target]
            dist.broadcast_object_list(shared, src=0)
            problem, staging, target = shared
        if problem:
            raise PlanError([problem])
        failure = None
        try:
            result = write(staging)
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, CheckpointException):
                causes = [e.failures[rank][0] for rank in sorted(e.failures)]
                e = next((c for c in causes if isinstance(c, Exception)), e)
            failure, result = first_line(e), None
        if many:  # a step one rank took alone (rank 0's files beside DCP's) may have failed there only
            failures = [None] * dist.get_world_size()
            dist.all_gather_object(failures, failure)
            failure = next((f for f in failures if f is not None), None)
        if failure is not None:
            if not distributed:  # (with ranks, one may still be writing there: the next save clears it)
                shutil.rmtree(staging, ignore_errors=True)
            kept = f"the previous checkpoint at {path} is untouched" if target.exists() else "nothing was published"
            raise plan_error(SL501, f"cannot write the checkpoint {path}: {failure}", (kept,))
        if rank0:
            publish(staging, target)
    if distributed:
        dist.barrier()  # no rank returns before the new checkpoint is visible
    return result, target


def check_save_target(path: str | os.PathLike, unreplaceable: Callable[[Path], str | None] | None = None) -> None:
    """PlanError(SL501) if a checkpoint must not be saved at `path` (see save_checkpoint; `unreplaceable`
    as for write_staged), or another save to it is running now."""
    with _save_lock(_save_target(Path(path), unreplaceable or _unreplaceable), Path(path)):
        pass


def _save_target(path: Path, unreplaceable: Callable[[Path], str | None]) -> Path:
    """The directory a checkpoint saved at `path` replaces, or PlanError(SL501).

    A symlink is followed: the checkpoint is written where it points (beside that directory, so the swap
    is one rename on its file system) and the link is kept, as writing into a linked directory does."""
    try:
        target = path.absolute().resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop: RuntimeError up to Python 3.12, OSError after
        raise plan_error(SL501, f"cannot save to {path}: {e}") from None
    problem = unreplaceable(target)
    if problem:
        shown = f"{path} (a link to {target})" if path.is_symlink() else str(path)
        raise plan_error(SL501, problem.replace(str(target), shown, 1))
    return target


@contextlib.contextmanager
def _save_lock(target: Path, shown: Path | None = None) -> Iterator[None]:
    """Hold the lock of saves to `target`: an flock on `.NAME.lock` beside it, which says who holds it.

    PlanError(SL501) naming the holder if another process holds it. The kernel drops an flock when its
    process dies however it dies, so a lock file left by a killed save is simply taken over; the file is
    removed (while locked) on release, and one that was removed as it was taken is taken again."""
    if fcntl is None:
        yield
        return
    lock = target.parent / f".{target.name}.lock"
    while True:
        try:
            # O_NOFOLLOW: a `.NAME.lock` planted as a symlink must not make us truncate what it points to
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(lock, flags, 0o644)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise OSError(errno.EINVAL, "not a regular file")
        except OSError as e:
            raise plan_error(
                SL501, f"cannot save to {target}: cannot create its lock {lock}: {e.strerror or e}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that has not said"
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise plan_error(SL501, f"cannot save to {target}: cannot lock {lock}: {e.strerror or e}") from None
            raise plan_error(
                SL501,
                f"cannot save to {shown or target}: another save to it is running ({holder})",
                (f"wait for it to finish or save elsewhere; {lock} is its lock, released when it exits",),
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # its holder removed it as we opened it: lock the file that is there now
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)


def _unreplaceable(path: Path) -> str | None:
    """Why `path` (symlinks resolved) must not be replaced by a checkpoint, or None."""
    if path.exists() and not path.is_dir():
        return f"cannot save to {path}: it is a file, not a checkpoint directory"
    if path.is_dir() and any(path.iterdir()) and not (path / ".metadata").is_file():
        return f"cannot save to {path}: it is a directory with files but no checkpoint; shardlang replaces only checkpoints"
    if not path.parent.is_dir():
        return f"cannot save to {path}: {path.parent} does not exist"
    return None


def publish(staging: Path, path: Path) -> None:
    """Put the finished checkpoint `staging` at `path`, replacing what is there in one step.

    On Linux, renameat2(RENAME_EXCHANGE) swaps the two directories atomically, so `path` is at every
    instant either the old checkpoint or the new one. Elsewhere the old one is first renamed aside
    (`.NAME.old-*`, which read_checkpoint points to should the process die in between), then removed."""
    _fsync_tree(staging)
    if not path.exists():
        os.rename(staging, path)
    elif _exchange(staging, path):
        shutil.rmtree(staging)
    else:
        aside = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(path, aside)
        os.rename(staging, path)
        shutil.rmtree(aside)
    _fsync_dir(path.parent)
    for stale in leftovers(path, "saving"):  # left by saves that were killed part way
        shutil.rmtree(stale, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    if ctypes.get_errno() in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(ctypes.get_errno(), f"cannot swap {a} into {b}: {os.strerror(ctypes.get_errno())}")


def leftovers(path: Path, kind: str) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.{kind}-*")) if path.parent.is_dir() else []


def _fsync_tree(root: Path) -> None:
    for file in root.iterdir():
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
