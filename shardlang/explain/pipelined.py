"""explain for a pipelined plan: every stage simulated on fake tensors one microbatch at a time, as
torch's PipelineStage runs it, and the measurements laid along the schedule's timetable (schedules.py)
into each pp rank's peak memory, in-flight microbatches, send/recv bytes, bubble and step time.

Per stage, under torch's memory trackers: a first microbatch's forward and backward (the warm-up: from
then on the stage holds its accumulated gradients, and FSDP units stay gathered, as torch's stage keeps
them between microbatches), a second one's forward and backward, measured phase by phase, and the end of
the step (torch's `perform_reduce_grad`, then the AdamW step). The backward is torch's own
(`PipelineStage.backward_maybe_with_nosync`, which sets FSDP's no-sync flags as the schedules do); the
received activation is a fake tensor of the previous stage's output, and the last stage's loss is the
model file's. Microbatches after the second are taken to act as the second (collectives, ops and memory).
"""

from __future__ import annotations

from collections import Counter

import attrs
import torch
from attrs import frozen

from ..frontend import ir
from .fakestep import (
    Collective,
    Peak,
    by_key,
    count_tokens,
    group_names,
    positions_as_on_real_tensors,
    quiet,
    recording_fake_mode,
    warm_adamw,
)
from .memory import ORDER
from .schedules import StageCost, play, textbook_bubble, timetable, walk
from .timing import Hardware, StepTime, dim_layout, link_of, step_time


@frozen
class StageReport:
    """One pipeline stage: what it holds and, with a simulated step, what one microbatch costs it."""

    stage: int
    pp_rank: int
    blocks: tuple[str, ...]  # its blocks of the stack, in order
    modules: tuple[str, ...]  # modules with parameters outside the stack it holds (first and last stage)
    parameters: int  # elements, unsharded
    parameter_bytes: int  # on a rank of the stage (rank R's place on every other mesh dim)
    in_flight: int  # the most microbatches of this stage live at once on its rank, by the timetable
    activations: int | None = None  # bytes one microbatch's forward keeps until its backward
    send: int | None = None  # bytes per step to other pp ranks: activations forward, input gradients back
    recv: int | None = None  # bytes per step from other pp ranks: activations, output gradients
    forward: float | None = None  # seconds per microbatch
    backward: float | None = None


@frozen
class PipeRank:
    """One pp rank over the step: its stages, its peak memory, how long it computes and waits."""

    pp_rank: int
    stages: tuple[int, ...]
    peak: int | None = None  # bytes, at the worst moment of the timetable
    busy: float | None = None  # seconds computing its stages' forwards and backwards
    bubble: float | None = None  # the part of the pipeline's span it waits
    p2p: float | None = None  # seconds of its sends (activations and gradients), one by one
    seconds: float | None = None  # its step: timetable, then gradient reduction and the optimizer step


@frozen
class PipelineReport:
    mesh_dim: str
    schedule: str
    torch_class: str
    order: str  # where the timetable comes from
    pp: int
    stages_per_rank: int
    microbatches: int
    pp_rank: int  # rank R's
    stages: tuple[StageReport, ...]
    ranks: tuple[PipeRank, ...]
    #: The idle part of all pp ranks' time: from the timed timetable with a step, else from the timetable
    #: with equal stages whose backward takes twice the forward (`bubble_basis` says which).
    bubble: float
    bubble_basis: str
    textbook_bubble: float  # (pp - 1) / (v m + pp - 1)
    microbatch: int | None = None  # examples per microbatch (the largest, when they differ)
    span: float | None = None  # seconds from the first forward to the last backward


def pp_size(plan: ir.Plan, world_size: int) -> int:
    pipeline = plan.pipeline
    mesh = plan.mesh(pipeline.mesh.mesh)
    return dict(zip(mesh.dim_names, mesh.shape(world_size)))[pipeline.mesh.dims[0]]


def pp_coordinates(plan: ir.Plan, world_size: int) -> tuple[list[int], int]:
    """Every global rank's pp index, and the rank stride of the pp dim (mesh dims row-major, last fastest)."""
    pipeline = plan.pipeline
    mesh = plan.mesh(pipeline.mesh.mesh)
    sizes = mesh.shape(world_size)
    at = mesh.dim_names.index(pipeline.mesh.dims[0])
    stride = 1
    for n in sizes[at + 1 :]:
        stride *= n
    return [(g // stride) % sizes[at] for g in range(world_size)], stride


def _held(part) -> list:
    seen, out = set(), []
    for p in part.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _nbytes(value) -> int:
    tensors = value if isinstance(value, (tuple, list)) else (value,)
    return sum(_local_bytes(t) for t in tensors if isinstance(t, torch.Tensor))


@attrs.define
class _Measured:
    """One stage, one microbatch at a time: its memory (StageCost), the collectives and op costs of
    the warm-up microbatch, of a steady one's forward and backward and of the end of the step, and the
    bytes it sends on (one microbatch's output) and receives."""

    cost: StageCost
    calls: dict[str, dict]
    tally: dict[str, Counter]
    sent: int
    received: int


def _sub(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) - b.get(k, 0) for k in a.keys() | b.keys()}


def _measure(
    plan: ir.Plan, applied_by_rank: dict, model_file, batch: int | None, microbatches: int, ran: list, stand_ins=None
):
    """Every stage measured in order (a stage receives the previous one's output): {stage: _Measured},
    the batch, tokens and data-parallel replicas. The step's phases are noted in `ran` (step.Step); what fake
    tensors cannot run runs on `stand_ins` where given (lint's step: fakestep.StandIns)."""
    from torch.distributed import pipelining

    from ..verification import Context
    from ..verification import layout as lay
    from ..verification.comms import Calls
    from ..verification.step import Step, not_compiled

    pipeline = plan.pipeline
    pp = len(applied_by_rank)
    ranks_of = pipeline.stage_ranks(pp)
    n, m = len(ranks_of), microbatches
    any_applied = next(iter(applied_by_rank.values()))
    ctx = Context(plan, any_applied, model_file)
    groups: dict[str, str] = {}
    for applied in applied_by_rank.values():
        groups.update(group_names(applied))
    stages = {}
    for s, r in enumerate(ranks_of):
        applied = applied_by_rank[r]
        part = applied.parts[s]
        group = applied.mesh(pipeline.mesh).get_group()
        stages[s] = (part, pipelining.PipelineStage(part, s, n, torch.device("cpu"), group=group))
    recorder = Calls()
    measured: dict[int, _Measured] = {}
    # The step as the checks run it: a simulated world compiles nothing (a compiled loss runs as it is).
    step = Step.of(ctx, compile_with=not_compiled, ran=ran)

    def stage_by_stage(inputs: tuple) -> list[int]:
        # torch's schedules split every tensor input (and the keyword `shardlang_inputs`) with tensor_split.
        chunks = lay.microbatches(inputs, m)
        sizes = [next(x for x in c if isinstance(x, torch.Tensor)).shape[0] for c in chunks]
        if min(sizes) == 0:
            raise ValueError(f"a batch of {batch} cannot be split into {m} microbatches")
        received_like: list = []
        for s in range(n):
            part, stage = stages[s]
            measured[s], received_like = _measure_stage(
                step, stage, part, s == n - 1, chunks, received_like, recorder, groups
            )
        return sizes

    # position ids read as the workers read them (a plain step's explain and lint do the same): on fake ones
    # transformers takes every batch for packed sequences (Youtu and Sarvam's MLA then raised)
    with (
        quiet("torch._subclasses.fake_tensor"),
        recording_fake_mode(recorder, stand_ins),
        positions_as_on_real_tensors(),
    ):
        where = step.where
        batch = batch if batch is not None else m * 2 * max(where.tp_size, 1)
        full = step.batch(size=batch)
        sizes = step.scheduled(stage_by_stage, full, m)
    return measured, batch, max(sizes), count_tokens(full, batch), where.replicas


def _measure_stage(step, stage, part, last: bool, chunks: list, received_like: list, recorder, groups):
    """One stage (torch's PipelineStage `stage` of module `part`) of the training step `step`, as the module
    docstring says: its _Measured, and the (shape, dtype) of each tensor it sends on (what the next stage
    receives)."""
    from ..runtime.pipeline import model_output
    from .fusednorm import cuda_like_rms_norm
    from .memory import tracker

    m = len(chunks)
    part.to_empty(device="cpu")
    optimizer = warm_adamw(part)
    memory = tracker(part, optimizer)
    memory.track_inputs(chunks[0])
    if m > 1:
        memory.track_inputs(chunks[1])
    marks: list = []

    def mark():
        marks.append((len(recorder.calls), Counter(memory.costs)))
        return memory.reading()

    def forward(i):
        memory.reset_mod_stats()  # the trackers' per-module stats are per call: the FSDP one needs this
        mb = chunks[i]
        if not received_like:
            given = []
            out = part(*mb, shardlang_inputs=mb)
        else:
            given = [torch.empty(shape, dtype=dtype, requires_grad=True) for shape, dtype in received_like]
            out = part(*given, shardlang_inputs=mb)
        kept = None
        if last:
            kept = out
            out = step.stage_loss(part, model_output(part.shardlang_carry, out), mb)
        return out, given, kept

    def backward(out, given):
        if last:
            grads = None
        elif isinstance(out, torch.Tensor):
            grads = torch.empty_like(out)
        else:
            grads = tuple(torch.empty_like(t) for t in out)
        stage.backward_maybe_with_nosync(
            "full", {"stage_output": out, "output_grads": grads, "input_values": given}, last_backward=False
        )

    sends = []
    with memory, cuda_like_rms_norm():
        mark()
        if m > 1:  # the warm-up microbatch
            out, given, kept = forward(0)
            backward(out, given)
            del out, given, kept
        steady, _ = mark()
        out, given, kept = forward(1 if m > 1 else 0)
        after_forward, at_forward = mark()
        sent = 0 if last else _nbytes(out)
        if not last:
            outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
            sends = [(tuple(t.shape), t.dtype) for t in (x.to_local() if hasattr(x, "to_local") else x for x in outs)]
        kept_bytes = _nbytes(kept) if last else 0
        received = sum(_nbytes(g) for g in given)
        backward(out, given)
        del out, given, kept
        _, at_backward = mark()
        stage.perform_reduce_grad(m)  # the runtime's Pipeline scales the gradients by the microbatches
        with recorder.paused():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _, at_end = mark()
    del optimizer
    # What a microbatch keeps until its backward: the activations its forward leaves. (Other categories
    # change too, once: FSDP reshards a unit after the forward that the previous backward kept
    # gathered. The steady state keeps them as they were, as during a backward.)
    kept_until_backward = max(0, after_forward["activations"] - steady["activations"])
    cost = StageCost(
        steady,
        {"activations": kept_until_backward},
        {"activations": kept_bytes} if kept_bytes else {},
        _sub(at_forward, steady),
        _sub(at_backward, {**steady, "activations": steady["activations"] + kept_until_backward}),
        _sub(at_end, steady),
    )
    phases = ("warmup", "F", "B", "end")
    calls = {p: by_key(recorder.calls[a[0] : b[0]], groups) for p, a, b in zip(phases, marks, marks[1:])}
    tally = {p: b[1] - a[1] for p, a, b in zip(phases, marks, marks[1:])}
    return _Measured(cost, calls, tally, sent, received), sends


def _collectives(calls: dict) -> tuple[Collective, ...]:
    return tuple(Collective(op, dim, c, b) for (op, dim), (c, b) in sorted(calls.items()))


def _add(total: dict, calls: dict, times: int = 1) -> None:
    for key, (c, b) in calls.items():
        tc, tb = total.get(key, (0, 0))
        total[key] = (tc + times * c, tb + times * b)


def pipeline_report(
    plan: ir.Plan,
    applied_by_rank: dict,
    world_size: int,
    rank: int,
    model_file=None,
    batch: int | None = None,
    hardware: Hardware | None = None,
    meshes=None,
    ran: list | None = None,
    stand_ins=None,
):
    """The pipeline seen from every pp rank. With a model file's example_input and `hardware`, one
    step is simulated stage by stage: (report, rank R's collectives, rank R's Peak, rank R's StepTime,
    None); else, or if the step fails, (report, (), None, None, the exception or None). The step's phases
    are noted in `ran` (step.Step.ran); lint's step passes its `stand_ins` (fakestep.StandIns)."""
    pipeline = plan.pipeline
    pp = len(applied_by_rank)
    v = pipeline.stages_per_rank
    m = pipeline.n_microbatches(pp)
    ranks_of = pipeline.stage_ranks(pp)
    n = len(ranks_of)
    name, _ = ir.SCHEDULES[pipeline.schedule]
    order, source = timetable(pipeline.schedule, pp, m, v)
    stages_of = {r: tuple(s for s in range(n) if ranks_of[s] == r) for r in range(pp)}
    split = next(iter(applied_by_rank.values())).linted.resolution.stages
    dim = f"{pipeline.mesh.mesh}.{pipeline.mesh.dims[0]}"
    held = {}
    for s, r in enumerate(ranks_of):
        params = _held(applied_by_rank[r].parts[s])
        held[s] = (sum(p.numel() for p in params), sum(_local_bytes(p) for p in params))
    mine = pp_coordinates(plan, world_size)[0][rank]

    def stage_row(s: int, in_flight: int, **measured) -> StageReport:
        outside = (split.first if s == 0 else ()) + (split.last if s == n - 1 else ())
        return StageReport(s, ranks_of[s], split.blocks[s], outside, *held[s], in_flight, **measured)

    failure = None
    if model_file is not None and model_file.example_input is not None and hardware is not None:
        try:
            measured, batch, microbatch, tokens, replicas = _measure(
                plan, applied_by_rank, model_file, batch, m, ran if ran is not None else [], stand_ins
            )
        except Exception as e:  # noqa: BLE001 - the stages stand; the step is what fails
            failure = e
    heading = (dim, pipeline.schedule, name, source, pp, v, m, mine)  # what both reports below open with
    if model_file is None or model_file.example_input is None or hardware is None or failure is not None:
        unit = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
        played = play(order, ranks_of, lambda s, kind: unit[kind] / v)
        empty = StageCost({}, {}, {}, {}, {}, {})
        walks = {r: walk(order[r], dict.fromkeys(stages_of[r], empty)) for r in range(pp)}
        report = PipelineReport(
            *heading,
            tuple(stage_row(s, walks[ranks_of[s]].in_flight[s]) for s in range(n)),
            tuple(PipeRank(r, stages_of[r], bubble=played.bubble(r)) for r in range(pp)),
            played.overall_bubble,
            "equal stages, backward twice the forward",
            textbook_bubble(pp, m, v),
        )
        return report, (), None, None, failure

    layout = dim_layout(meshes, world_size, hardware.gpus_per_node)
    link, _, _ = link_of(dim, layout, world_size, hardware)

    def seconds(calls: dict, tally: Counter) -> float:
        return step_time(tuple(sorted(tally.items())), _collectives(calls), meshes, world_size, hardware, 0, 1).seconds

    times = {}
    for s, x in measured.items():
        f, b = seconds(x.calls["F"], x.tally["F"]), seconds(x.calls["B"], x.tally["B"])
        times[s] = {"F": f, "B": b, "I": b / 2, "W": b / 2, "end": seconds(x.calls["end"], x.tally["end"])}

    def transfer(s: int) -> float:
        return measured[s].sent / link.bandwidth + link.latency

    played = play(order, ranks_of, lambda s, kind: times[s][kind], transfer)
    walks = {r: walk(order[r], {s: measured[s].cost for s in stages_of[r]}) for r in range(pp)}
    rows = []
    for s in range(n):
        forward_out = measured[s].sent if s < n - 1 and ranks_of[s + 1] != ranks_of[s] else 0
        backward_out = measured[s].received if s > 0 and ranks_of[s - 1] != ranks_of[s] else 0
        rows.append(
            stage_row(
                s,
                walks[ranks_of[s]].in_flight[s],
                activations=sum(measured[s].cost.activations.values()),
                send=m * (forward_out + backward_out),
                recv=m * (forward_out + backward_out),  # the same tensors' shapes, the other way
                forward=times[s]["F"],
                backward=times[s]["B"],
            )
        )
    pipe_ranks = []
    for r in range(pp):
        p2p = 0.0
        for s, kind, _ in order[r]:
            if kind == "F" and s < n - 1 and ranks_of[s + 1] != r:
                p2p += transfer(s)
            elif kind in ("B", "I") and s > 0 and ranks_of[s - 1] != r:
                p2p += transfer(s - 1)
        step = played.finish[r] + sum(times[s]["end"] for s in stages_of[r])
        pipe_ranks.append(PipeRank(r, stages_of[r], walks[r].peak, played.busy[r], played.bubble(r), p2p, step))
    report = PipelineReport(
        *heading,
        tuple(rows),
        tuple(pipe_ranks),
        played.overall_bubble,
        "timed: each stage's forward and backward on the accelerator, sends over the pp link",
        textbook_bubble(pp, m, v),
        microbatch,
        played.span,
    )
    # Rank R: its stages' collectives and ops over the whole step, its peak, the pipeline's step time.
    calls: dict = {}
    tally: Counter = Counter()
    for s in stages_of[mine]:
        x = measured[s]
        if m > 1:
            _add(calls, x.calls["warmup"])
            tally.update(x.tally["warmup"])
        for phase in ("F", "B"):
            _add(calls, x.calls[phase], m - 1 if m > 1 else 1)
            for key, count in x.tally[phase].items():
                tally[key] += count * (m - 1 if m > 1 else 1)
        _add(calls, x.calls["end"])
        tally.update(x.tally["end"])
    collectives = _collectives(calls)
    walked = walks[mine]
    peak = Peak(walked.peak, tuple((k, walked.categories.get(k, 0)) for k in ORDER), (), batch, tokens, replicas)
    whole = max(r.seconds for r in pipe_ranks)
    timed = step_time(tuple(sorted(tally.items())), collectives, meshes, world_size, hardware, tokens, replicas)
    timed: StepTime = attrs.evolve(
        timed,
        seconds=whole,
        tokens_per_s=tokens * replicas / whole if whole else 0.0,
        mfu=timed.model_flops / (whole * hardware.bf16) if whole else 0.0,
    )
    return report, collectives, peak, timed, None
