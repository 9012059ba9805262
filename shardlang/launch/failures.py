"""A job's failure on a worker, as plain data that crosses a queue and as the WorkerError the launcher raises."""

from __future__ import annotations

import pickle
import traceback
from typing import Any

from .frames import user_stack, where


class WorkerError(RuntimeError):
    """A job failed on a worker (or a worker died, or the workers did not start).

    `details` is the whole traceback; `user` the frames of it in the user's own files (their model
    file, their styles), one `file:line in function: code` each, which is what a user needs; `diagnostics` the
    Diagnostics when the job said where in the plan it failed (a check that raised: SL400 at the check, and
    at the rule of the module that was running)."""

    def __init__(
        self,
        rank: int,
        message: str,
        details: str = "",
        user: tuple[str, ...] = (),
        diagnostics: tuple[Any, ...] = (),
        died: bool = False,
        summary: str | None = None,
        kind: str = "raised",
    ):
        super().__init__(f"rank {rank}: {message}")
        self.rank, self.message, self.details, self.user = rank, message, details, user
        self.diagnostics, self.died = tuple(diagnostics), died
        self.summary = summary  # the one line that says what happened (default: `rank R failed: message`)
        #: What ended the job: "raised", "died", "timeout" (a job past its time) or "startup" (the workers
        #: did not all start); and what every rank last said (WorkerPool.ranks), set by the pool.
        self.kind = "died" if died else kind
        self.ranks: list[dict[str, Any]] = []

    @property
    def headline(self) -> str:
        if self.summary is not None:
            return self.summary
        first = self.message.splitlines()[0] if self.message else ""
        return f"rank {self.rank} {'died' if self.died else 'failed'}: {first}"

    @property
    def diagnostic(self) -> Any:
        """The first diagnostic (the check's SL400), or None."""
        return self.diagnostics[0] if self.diagnostics else None

    def __str__(self) -> str:
        text = f"rank {self.rank}: {self.message}"
        return f"{text}\n{self.details.rstrip()}" if self.details else text


def failure_of(error: BaseException) -> dict[str, Any]:
    """What the launcher needs to report a job's exception (plain data: it crosses a queue)."""
    from ..runtime.modelfile import ModelFileError

    message = str(error) if isinstance(error, ModelFileError) else f"{type(error).__name__}: {error}"
    diagnostics = tuple(getattr(error, "diagnostics", ()))
    try:
        pickle.dumps(diagnostics)
    except Exception:  # noqa: BLE001 - diagnostics that do not pickle are left out
        diagnostics = ()
    return {
        "message": getattr(error, "summary", None) or message,
        "details": "".join(traceback.format_exception(error)),
        "user": tuple(where(f) for f in user_stack(error)),
        "diagnostics": diagnostics,
    }


def worker_error(rank: int, failure: dict[str, Any]) -> WorkerError:
    return WorkerError(rank, failure["message"], failure["details"], failure["user"], failure["diagnostics"])
