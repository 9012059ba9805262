"""What the commands read: the plan (compiled with -D and the world), the model file (on meta), the world
size a plan fixes, and the order the model's modules run in."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..frontend.diagnostics import Diagnostic
from ..frontend.ir import Plan
from ..frontend.read import read_file
from ..frontend.source import Source
from .arguments import defines
from .signals import time_limit
from .status import UsageError

if TYPE_CHECKING:  # torch is imported only where a command needs it: `lint` without a model never does
    from ..runtime.modelfile import ModelFile


def load_model(args: argparse.Namespace) -> ModelFile | None:
    if args.model is None and args.entry is None and args.hf is None:
        return None
    from ..runtime.modelfile import ModelFileError, load_model_file

    with time_limit(getattr(args, "timeout", None), f"loading {model_arg(args).strip()}"):
        try:
            return load_model_file(args.model, args.entry, hf=args.hf, seq=args.seq, keep_alive=True)
        except ModelFileError as e:
            raise UsageError(str(e)) from None


def model_arg(args: argparse.Namespace) -> str:
    """The model as the command line named it: ` MODEL`, ` --entry E` or ` --hf PATH`, or ""."""
    if args.model:
        return f" {args.model}"
    return f" --entry {args.entry}" if args.entry else f" --hf {args.hf}" if args.hf else ""


def meta_model(model_file: ModelFile, timeout: float | None = None):
    from ..runtime.modelfile import ModelFileError

    with time_limit(timeout, f"build_model() from {model_file.origin}"):
        try:
            return model_file.build_on_meta(keep_alive=True)
        except ModelFileError as e:
            raise UsageError(str(e)) from None


def plan_world(plan: Plan, given: int | None) -> int:
    if given is not None:
        return given
    try:
        return plan.fixed_world_size()
    except ValueError as e:
        raise UsageError(f"{e} with --world N") from None


def compile_plan(
    path: str, params: list[str], world_size: int | None
) -> tuple[Plan | None, list[Diagnostic], dict[str, Source]]:
    """The front end for a command: diagnostics are returned, and an unreadable file is a usage error."""
    try:
        return read_file(path, defines(params), world_size)
    except OSError as e:
        raise UsageError(f"cannot read plan {path}: {e.strerror}") from None


def order_for(plan: Plan, model, model_file: ModelFile):
    """The order the model's modules run in, for the lint rules that follow activations through it (SL210:
    plans with tensor parallelism) and for a pipeline, whose modules outside the stack go where they run."""
    return order_always(model, model_file) if plan.parallelize or plan.pipeline is not None else None


def order_always(model, model_file: ModelFile):
    """The order the model's modules run in, traced on meta from its example_input (compiler.trace)."""
    from ..compiler.trace import Order, trace_order

    if model_file.example_input is None:
        return Order(None, f"{model_file.origin} defines no example_input")
    try:
        with time_limit(TRACE_S, "its traced forward"):
            return trace_order(model, model_file.example_input)
    except UsageError:
        return Order(None, f"its forward did not finish within {TRACE_S:g} s")


#: How long the traced forward may run. It runs in the command's own process (lint, apply's launcher),
#: before any worker starts: a model whose forward never returns must not hang the command there, where
#: neither `--timeout` nor the workers' signals reach it.
TRACE_S = 10.0
