"""One rank's `shardlang apply`: load the plan and the model file, build, apply, check, report.

Every rank returns the same report. Run by local worker processes, under torchrun, or by the
library's `shardlang.verify`."""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from attrs import frozen

from ..checkpoints.formats import load_weights, read_weights, save_weights
from ..checkpoints.records import Transfer
from ..compiler.devices import mesh_device
from ..compiler.trace import Order
from ..frontend import ir
from ..frontend.diagnostics import SL400, Diagnostic, PlanError
from ..frontend.read import read_file
from ..frontend.source import Span
from ..runtime.apply import apply_plan, build_for_plan
from ..runtime.modelfile import ModelFile, ModelFileError, check_module, load_model_file, user_code
from ..verification import FAIL, PASS, Context, combine, gather, run_checks
from ..verification.layout import layout
from . import raised
from .report import Report, unanswered_checks
from .workers import progress


class CheckRaised(Exception):
    """A check raised (the model's forward, or torch inside the check): SL400 at the check, and where a
    module of the model was running, SL400 at the plan statement that governs it; for the launcher.

    Raised out of the job rather than turned into a report: the other ranks may be waiting in a
    collective that this rank will never join, and the launcher stops them."""

    def __init__(self, diagnostics: tuple[Diagnostic, ...], summary: str):
        super().__init__(summary)
        self.diagnostics, self.summary = diagnostics, summary

    @property
    def diagnostic(self) -> Diagnostic:
        return self.diagnostics[0]


@frozen
class Job:
    """What every rank needs to run `shardlang apply`. It crosses processes, so the plan and the model
    are named by path (or given as a Plan and a ModelFile of importable functions, from the library)."""

    plan: str | ir.Plan
    params: dict[str, Any]
    model: str | None
    entry: str | None
    checks: tuple[ir.Check, ...]
    seed: int = 0
    model_file: ModelFile | None = None
    load: str | None = None  # a checkpoint or HF weights to load after the plan is applied, before the checks
    save: str | None = None  # where to save one after the checks, if they passed
    save_format: str = "dcp"  # ... as a DCP checkpoint, or as Hugging Face weights ("hf")
    explicit: bool = False  # the checks were asked for (by the plan's verify or --verify): each must run
    order: Order | None = None  # the order the model's modules run in, traced once by the launcher (SL210)


def run(job: Job) -> Report:
    """Apply and verify on this rank; every rank returns the same report. Python warnings raised on
    any rank (torch's included) are collected into the report, once each, instead of being printed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = _run(job)
    gradients_passed = any(c.check == "gradients" and c.status == PASS for c in report.checks)
    # FSDP2 warns when a unit returns a view: a TP output layer's hook returns `to_local()`, a view,
    # so every plan with a TP output layer in a unit (and its root) raises it. It is harmless unless
    # code modifies that output in place, and then gradients would be wrong; so where the gradients
    # check passed, it is left out of the report.
    if gradients_passed:
        caught = [w for w in caught if "returned a view tensor" not in str(w.message)]
    return attrs.evolve(report, warnings=report.warnings + _unique(caught))


#: FSDP2's view warning names the classes of its unit's modules: one line for every unit, whatever its class.
_VIEW = re.compile(r"FSDP2-wrapped module \((.*?)\) returned a view tensor")
_VIEWS = "FSDP2-wrapped modules returned a view tensor"


def _unique(caught) -> tuple[str, ...]:
    """Each warning once, with how many times the ranks raised it; FSDP2's view warning, raised by every
    unit with its modules' classes in it, once for them all, naming the classes."""
    seen: dict[str, int] = {}
    classes: set[str] = set()
    for w in caught:
        text = str(w.message)
        found = _VIEW.search(text)
        if found is not None:
            classes.add(found.group(1))
            text = _VIEW.sub(_VIEWS, text)
        key = f"{w.category.__name__}: {text.splitlines()[0]} ({Path(w.filename).name}:{w.lineno})"
        seen[key] = seen.get(key, 0) + 1
    everyone = [(seen, classes)]
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (seen, classes))
    merged: dict[str, int] = {}
    for counts, _ in everyone:
        for key, n in counts.items():
            merged[key] = merged.get(key, 0) + n
    named = ", ".join(sorted(set().union(*(c for _, c in everyone))))
    lines = []
    for key, n in merged.items():
        key += f" [units of {named}]" if _VIEWS in key else ""
        lines.append(f"{key} [{n}x over all ranks]" if n > 1 else key)
    return tuple(lines)


def _run(job: Job) -> Report:
    start = time.perf_counter()
    world = dist.get_world_size()
    if isinstance(job.plan, ir.Plan):
        plan = job.plan
    else:
        plan, found, _ = read_file(job.plan, job.params, world)
        if plan is None:
            return _failed(world, found)
    progress("loading the model file")
    model_file = job.model_file or load_model_file(job.model, job.entry)
    torch.manual_seed(job.seed)  # every rank builds the same model
    progress("building the model")
    with user_code(f"build_model() from {model_file.origin}"):
        model = build_for_plan(plan, model_file.build_model)
    check_module(model, model_file.origin)
    progress("applying the plan")
    try:
        applied = apply_plan(plan, model, order=job.order)
    except PlanError as e:
        return attrs.evolve(_failed(world, e.diagnostics), details=e.details)
    applied_s = time.perf_counter() - start
    transfers: dict[str, Transfer] = {}
    checkpoint = None
    if job.load is not None:
        progress(f"loading {job.load}")
        try:
            checkpoint = read_weights(job.load)
            transfers["loaded"] = load_weights(applied.model, checkpoint)
        except PlanError as e:
            return _failed(world, e.diagnostics)
    ctx = Context(plan, applied, model_file, checkpoint=checkpoint, seed=job.seed)
    checked = time.perf_counter()
    running: list[str] = []

    def starting(name: str) -> None:
        running.append(name)
        progress(f"check {name}")

    finished: dict[str, int] = {}  # when each module of the sharded model last finished its forward
    try:
        with raised.watching(applied.model, finished):
            results = run_checks(ctx, job.checks, progress=starting)
    except ModelFileError:
        raise  # example_input or loss is unusable: the launcher says so (exit status 2)
    except Exception as e:
        raise _raised(ctx, running[-1] if running else "?", job.checks, e, finished) from e
    checks = tuple(combine(gather(results)))
    failures = tuple(d for c in checks if c.status == FAIL for d in _failure(c, job.checks))
    unrun = unanswered_checks(checks, job.explicit, job.load is not None)
    warnings = tuple(d for d in applied.linted.diagnostics if not d.is_error) + plan.diagnostics
    where = layout(ctx)
    shape = f"{where.replicas} replica{'s' if where.replicas > 1 else ''}"
    # the dims whose ranks share a replica's batch, by name (tp, an ep that shares its tokens, cp)
    shape += f" x {'*'.join(where.tp_dims)} {where.tp_size}" if where.tp_dims else ""
    shape += f" x pp {where.pp_size}" if where.pp_dim else ""
    checks_s = time.perf_counter() - checked
    notes: tuple[str, ...] = ()
    if job.save is not None and failures:
        notes = (f"not saved to {job.save}: a check failed (what was there is untouched)",)
    elif job.save is not None:
        progress(f"saving {job.save}")
        info = {
            "plan": str(job.plan) if not isinstance(job.plan, ir.Plan) else "<library plan>",
            "params": job.params,
            "layout": shape,
        }
        try:
            transfers["saved"] = save_weights(applied.model, job.save, job.save_format, ctx.optimizer, info=info)
        except PlanError as e:
            return attrs.evolve(_failed(world, warnings + failures + e.diagnostics), checks=checks)
    total = time.perf_counter() - start
    stages = (
        ("apply", applied_s),
        ("load", transfers.get("loaded")),
        ("checks", checks_s),
        ("save", transfers.get("saved")),
        ("total", total),
    )
    seconds = {name: getattr(t, "seconds", t) for name, t in stages if t is not None}
    notes += tuple(unanswered(c) for c in unrun)
    return Report(
        ok=not failures and not unrun,
        world_size=world,
        device=_device(plan),
        checks=checks,
        diagnostics=warnings + failures,
        notes=notes,
        usable=not unrun,
        seconds=seconds,
        layout=shape,
        checkpoints=transfers,
    )


def unanswered(result) -> str:
    """The note on a check that was asked for and compared nothing: its reason said once (the checks'
    messages themselves start `nothing compared: ...`)."""
    why = result.message.removeprefix("nothing compared: ")
    return f"check {result.check} was asked for but compared nothing: {why}"


def _failure(result, checks) -> tuple[Diagnostic, ...]:
    """SL400 at the check's verify statement; and where the gradients check localised the failure, SL400
    at the plan statement that governs the first module that disagrees."""
    found = [
        Diagnostic(
            SL400,
            f"check {result.check} failed",
            next((k.span for k in checks if k.name == result.check), None),
            tuple(part.strip() for part in result.message.split("; ")[:4]),
        )
    ]
    where = result.data.get("localised")
    if where:
        statements = where["statements"]
        spans = [Span(s["file"], s["line"], s["col"], s["end_line"], s["end_col"]) for s in statements]
        call = f" (call {where['call']})" if where["call"] > 1 else ""
        helps = (
            *where.get("help", ()),
            *(f"{s['what']}: {s['file']}:{s['line']}:{s['col']}: {s['text']}" for s in statements[1:]),
        )
        if not statements:  # the module's own rule, where there is one, is the diagnostic's place
            helps = helps or ("no plan statement governs this module itself; look at the rules around it",)
        found.append(
            Diagnostic(
                SL400,
                f"first disagreement: module '{where['module']}' ({where['class']}){call}, its {where['what']}",
                spans[0] if spans else None,
                helps,
                label=statements[0]["what"] if statements else "",
            )
        )
    return tuple(found)


def _raised(ctx: Context, name: str, checks, error: Exception, finished: dict[str, int]) -> CheckRaised:
    """SL400 at the check's statement for a check that raised, with the user's frames as help; and where
    a module of the sharded model was running (its forward or its hooks), SL400 at the plan statement
    that governs it, with the line of its code that was running and the package that code belongs to."""
    from .frames import package_of, user_stack, where

    what = raised.summary(error)
    rank = dist.get_rank() if dist.is_initialized() else 0
    frames = [where(f) for f in user_stack(error)]
    found = raised.raising_module(ctx.model, error)
    origins = [package_of(f) for f in raised.filenames(error)[::-1]]  # innermost first; None: the user's file
    packages = list(dict.fromkeys(o[0] for o in origins if o is not None and o[0] != "python"))
    inside = ()
    if not frames and found is None:
        callers = f" (called from {', '.join(packages[1:])})" if len(packages) > 1 else ""
        inside = (f"raised inside {packages[0] if packages else 'python'}{callers}, not in your files",)
    help = (*(f"at {w}" for w in frames[-3:]), *inside, "run with --debug for the full traceback")
    span = next((c.span for c in checks if c.name == name), None)
    summary = f"check {name} raised on rank {rank}: {what}"
    diagnostics = [Diagnostic(SL400, summary, span, help)]
    if found is not None:
        message = f"raised in {raised.module_text(found)}: {what}"
        swapped = raised.swapped_pair(ctx, found[0], found[1], raised.first_argument(found[1], error))
        diagnostics.append(raised.in_module(ctx, found, message, finished, SL400, (swapped,) if swapped else ()))
    return CheckRaised(tuple(diagnostics), summary)


def _failed(world: int, diagnostics) -> Report:
    return Report(ok=False, world_size=world, device=_backend_device(), diagnostics=tuple(diagnostics), usable=False)


def _device(plan: ir.Plan) -> str:
    kinds = sorted({mesh_device(m.device) for m in plan.meshes}) or ["cpu"]
    return f"{'+'.join(kinds)} ({dist.get_backend()})"


def _backend_device() -> str:
    return f"cpu ({dist.get_backend()})" if dist.get_backend() != "nccl" else "cuda (nccl)"
