"""Helpers the checkpoint modules share: their PlanError, one line of an exception, a dtype's name, whether
a real process group is up, and whether a name is a plain file name."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..frontend.diagnostics import Code, Diagnostic, PlanError


def process_group_up() -> bool:
    """A real process group to save and load over (the fake one of `explain` is none)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake"


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as messages name it: `bfloat16` for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def first_line(e: BaseException) -> str:
    """An exception in one line: its class and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def plan_error(code: Code, message: str, help_: tuple[str, ...] = ()) -> PlanError:
    """A PlanError of one diagnostic with no place in the plan: a checkpoint's problem is not the plan's."""
    return PlanError([Diagnostic(code, message, None, help_)])


def is_plain_name(name: str) -> bool:
    """A file directly in the checkpoint directory: no separators, no `..`, no NUL (DCP opens
    `directory / name`, where an absolute name or `..` would read any file)."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")
