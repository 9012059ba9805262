"""`shardlang apply`: compile and lint here, then run the job on every rank and print rank 0's report."""

from __future__ import annotations

import argparse
import os
import sys
import time

import attrs
from rich.console import Console

from ...frontend.diagnostics import PlanError, did_you_mean, sort_key
from ...frontend.ir import Plan
from ..arguments import defines
from ..inputs import compile_plan, load_model, meta_model, order_for
from ..launcher import prepare_workers, run_local, run_under_torchrun, show_report, worker_failed
from ..output import Out, emit_diagnostics
from ..signals import Terminated, exit_now, terminable
from ..status import OK, UNUSABLE, UsageError

#: Under torchrun, how long a failing rank other than 0 waits before it exits (see run_apply).
RANK0_GRACE_S = 10.0


def run_apply(args: argparse.Namespace) -> int:
    """Compile and lint here, then run the job on every rank; rank 0's report. Exit 0 / 1 (SL400) / 2.
    With --json, one object on stdout on every way out (main prints the line on stderr as always)."""
    out = Out(args.json)
    try:
        return _apply(args, out)
    except UsageError as e:
        out.failed(UNUSABLE, {"kind": "usage", "message": str(e)})
        raise
    except KeyboardInterrupt as e:
        message = "interrupted (Ctrl-C); no worker is left running"
        out.failed(130, {"kind": "interrupted", "message": message}, ranks=getattr(e, "ranks", None))
        raise
    except Terminated as e:
        message = f"stopped by {e.name}; no worker is left running"
        out.failed(128 + e.signum, {"kind": "terminated", "message": message}, ranks=getattr(e, "ranks", None))
        raise
    except Exception as e:
        # A bug of shardlang's own: the traceback follows on stderr, and Python exits with status 1.
        out.failed(1, {"kind": "internal", "message": f"{type(e).__name__}: {e}"})
        raise


def _apply(args: argparse.Namespace, out: Out) -> int:
    from ...compiler.lint import lint
    from ...launch.failures import WorkerError
    from ...launch.workers import under_torchrun

    if args.save_format != "dcp" and args.save is None:
        raise UsageError(f"--save-format {args.save_format} says how --save writes: give --save DIR too")
    torchrun = under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc
    out.world = world or 0
    device = _apply_device(args.device, world)
    out.device = f"{device} ({'nccl' if device == 'cuda' else 'gloo'})"
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # an `auto` mesh means cpu here, as on the workers
    plan, found, sources = compile_plan(args.plan, args.params, world)
    if plan is None:
        return _apply_unusable(found, sources, out, world or 0, device)
    if world is None:
        world = _default_nproc(plan, device)
    _enough_gpus(device, world, torchrun)
    out.world = world
    model_file = load_model(args)
    if model_file is None:
        raise UsageError(
            "apply needs a model: MODEL (a file defining build_model), --entry package.module:function or --hf PATH"
        )
    checks = _checks(plan, args)
    explicit = args.verify is not None or any(c.span is not None for c in plan.checks)
    needs_input = [c.name for c in checks if c.name in ("gradients", "comms")]
    if explicit and needs_input and model_file.example_input is None:
        raise UsageError(
            f"{model_file.origin} defines no example_input(batch, generator), which {' and '.join(needs_input)} need"
        )
    meta = meta_model(model_file, args.timeout)
    if next(meta.parameters(), None) is None:
        raise UsageError(
            f"build_model() from {model_file.origin} returned a model without parameters: nothing to shard"
        )
    try:
        _check_checkpoint_paths(args, meta)
    except PlanError as e:
        return _apply_unusable([*found, *e.diagnostics], sources, out, world, device)
    if not torchrun:
        prepare_workers(args)  # its imports overlap lint's trace of the model
    order = order_for(plan, meta, model_file)
    linted = lint(plan, meta, world, order=order)
    if not linted.ok:
        return _apply_unusable(sorted([*found, *linted.diagnostics], key=sort_key), sources, out, world, device)

    from ...launch.job import Job

    job = Job(
        args.plan,
        defines(args.params),
        args.model,
        args.entry,
        checks,
        args.seed,
        model_file=model_file if args.hf else None,  # crosses to the workers by its config's path
        load=args.load,
        save=args.save,
        save_format=args.save_format,
        explicit=explicit,
        order=order,
    )
    console = Console(file=sys.stderr, highlight=False)
    warnings: list[str] = []
    if torchrun:
        rank = int(os.environ["RANK"])
        out.json = out.json and rank == 0  # rank 0 prints the object; under torchrun it knows only itself
        try:
            # torchrun stops the other ranks with SIGTERM when one fails: rank 0 still prints its object
            with terminable():
                report = run_under_torchrun(job, device, console)
        except WorkerError as e:  # this rank's own failure
            status = worker_failed(e, sources, args.debug, out)
            if rank != 0:
                # torchrun stops every rank once one exits: rank 0, likely failing alike, gets a moment to
                # say so in its object before it is stopped
                time.sleep(RANK0_GRACE_S)
            exit_now(status)
        exit_now(OK if report is None else show_report(report, warnings, sources, args, out))  # None: not rank 0
    try:
        with terminable():
            report, warnings = run_local(job, world, device, args.timeout, console, args.debug, out)
    except WorkerError as e:
        return worker_failed(e, sources, args.debug, out)
    if args.debug and report.details:
        print(report.details.rstrip(), file=sys.stderr)
    return show_report(report, warnings, sources, args, out)


def _check_checkpoint_paths(args: argparse.Namespace, meta) -> None:
    """Before any worker starts: --load names a checkpoint or HF weights that fit the model (from metadata
    and headers alone), --save a replaceable path."""
    from ...checkpoints.formats import check_target, check_weights_fit, read_weights

    if args.load is not None:
        check_weights_fit(read_weights(args.load), meta)
    if args.save is not None:
        check_target(args.save, args.save_format)


def _apply_device(choice: str, world: int | None) -> str:
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no GPU is available")
    if choice != "auto":
        return choice
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    from ...launch.workers import under_torchrun

    return "cuda" if gpus and (world is None or world <= gpus or under_torchrun()) else "cpu"


def _enough_gpus(device: str, world: int, torchrun: bool) -> None:
    """Local workers on cuda take one GPU each: refuse a world larger than the GPUs before any starts."""
    import torch

    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if device == "cuda" and not torchrun and world > gpus:
        raise UsageError(
            f"{world} ranks on cuda need {world} GPUs, one each, and this machine has {gpus}: give --nproc {gpus} "
            f"or fewer (with a plan whose meshes fit), or run on the CPU with --device cpu (gloo)"
        )


def _default_nproc(plan: Plan, device: str) -> int:
    try:
        return plan.fixed_world_size()
    except ValueError:
        if device == "cuda":
            import torch

            return torch.cuda.device_count()
        raise UsageError("the plan's meshes have auto dims: give --nproc N") from None


def _checks(plan: Plan, args: argparse.Namespace) -> tuple:
    """The checks to run: the plan's, or --verify's (with the plan's arguments where it has them)."""
    from ...frontend.ir import Check
    from ...frontend.schema import CHECKS

    checks = plan.checks
    if args.verify is not None:
        names = [] if args.verify.strip() == "none" else [n.strip() for n in args.verify.split(",") if n.strip()]
        unknown = [n for n in names if n not in CHECKS]
        if unknown:
            hint = did_you_mean(unknown[0], CHECKS)
            raise UsageError(
                f"unknown check '{unknown[0]}' in --verify"
                + (f"; {hint[0]}" if hint else f"; checks: {', '.join(CHECKS)}")
            )
        given = {c.name: c for c in plan.checks}
        checks = tuple(given.get(n) or Check(n, (), None) for n in names)
    for name in ("steps", "optimizer"):
        value = getattr(args, name)
        if value is not None:
            checks = tuple(
                attrs.evolve(c, args=tuple((k, v) for k, v in c.args if k != name) + ((name, value),))
                if c.name == "gradients"
                else c
                for c in checks
            )
    return checks


def _apply_unusable(found, sources, out: Out, world: int, device: str) -> int:
    # The report (and the checks it describes) is imported here, not at the top: `lint` never needs it.
    from ...launch.report import Report

    if out.json:
        out.report(
            Report(
                ok=False, world_size=world, device=device, diagnostics=tuple(found), usable=False, exit_status=UNUSABLE
            )
        )
    else:
        emit_diagnostics(found, sources, "text", stream=sys.stderr)
    return UNUSABLE
