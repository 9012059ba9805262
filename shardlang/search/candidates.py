"""The plans `shardlang search` weighs: each mesh factorisation the model takes (data, tensor, context,
expert and pipeline parallelism), written by `init`'s starter (compiler.starter.init_plan) with what it proposes for
each dim, and the options around it: activation checkpointing (none, every block, every other block),
FSDP's `reshard_after_forward`, `compile` of the blocks and the loss, and (where nothing else fits) FSDP's
CPU offload.

A factorisation the model cannot take (no rule to shard over tp, no SDPA attention for cp, no experts for
ep) is not a candidate: init leaves that dim out, and the search would weigh a plan it did not ask for. A
layout beyond plain data parallelism is settled as init settles its starter (`settled`, in a worker): linted
with the simulated step at the search's world, each feature the step finds cannot run left out with its
group (compiler.dropping), so that explain weighs a plan that runs (torchtitan's 1B: the rules proposed for
its tied embedding and output layer)."""

from __future__ import annotations

import torch.nn as nn
from attrs import evolve, frozen

from ..compiler.starter import block_stacks, init_plan

#: Activation checkpointing of a stack's blocks.
CHECKPOINTING = ("none", "every other", "every")
#: The largest tensor-parallel size weighed: TP past one node's NVLink domain is never the fastest.
MAX_TP = 8
#: The pipeline sizes weighed, with tensor and data parallelism only (not with cp or ep). Their 1F1B runs
#: PIPELINE_MICROBATCHES micro-batches where the batch per replica allows (else one a stage), so that
#: apply's gradients check (a batch of 4 by default) splits into as many.
PIPELINES = (2, 4)
PIPELINE_MICROBATCHES = 4


@frozen
class Layout:
    """One factorisation of the world: world = pp x dp x ep x cp x tp (ep borrows data-parallel ranks)."""

    dp: int
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1

    def __str__(self) -> str:
        parts = [f"pp{self.pp}"] if self.pp > 1 else []
        parts += [f"dp{self.dp}"] + [f"{name}{size}" for name, size in self.extra() if size > 1 and name != "pp"]
        return " ".join(parts)

    def extra(self) -> tuple[tuple[str, int], ...]:
        return (("ep", self.ep), ("cp", self.cp), ("tp", self.tp), ("pp", self.pp))


@frozen
class Candidate:
    """A plan: its layout and options, and its text."""

    layout: Layout
    text: str
    checkpoint: str = "none"
    reshard: bool = True
    compiled: bool = False
    offload: bool = False
    microbatches: int | None = None  # a pipelined layout's 1F1B micro-batches

    @property
    def name(self) -> str:
        options = [f"1f1b over {self.microbatches} micro-batches"] if self.microbatches else []
        options += [f"ac {self.checkpoint}" if self.checkpoint != "none" else "no ac"]
        options += [] if self.reshard else ["no reshard"]
        options += ["compiled"] if self.compiled else []
        options += ["offload"] if self.offload else []
        return f"{self.layout}, {', '.join(options)}"


def layouts(
    model: nn.Module, world: int, gpus_per_node: int, experts: bool, attention: bool, pipelines: tuple[int, ...] = ()
) -> list[Layout]:
    """Every factorisation of `world` the search weighs: tp within a node (at most MAX_TP), cp where the
    model has SDPA attention, ep where it has experts, dp what is left (at least 1); and each pipeline size
    of `pipelines` (those the model can be cut into) with tp and dp."""
    sizes = [d for d in range(1, world + 1) if world % d == 0]
    found = []
    for tp in (d for d in sizes if d <= min(gpus_per_node, MAX_TP)):
        for cp in (d for d in sizes if d <= 8) if attention else (1,):
            for ep in sizes if experts else (1,):
                if world % (tp * cp * ep) == 0:
                    found.append(Layout(world // (tp * cp * ep), tp, cp, ep))
        found += [Layout(world // (pp * tp), tp, pp=pp) for pp in pipelines if world % (pp * tp) == 0]
    return found


def microbatches(layout: Layout, per_replica: int) -> int | None:
    """The micro-batches a pipelined layout's 1F1B runs at `per_replica` sequences a step: PIPELINE_MICROBATCHES
    where they divide it and are at least one a stage, else one a stage where that divides it; None where
    neither does (the layout is then no candidate at these tokens per step)."""
    for count in (max(PIPELINE_MICROBATCHES, layout.pp), layout.pp):
        if per_replica % count == 0:
            return count
    return None


def base_plans(
    model: nn.Module, world: int, gpus_per_node: int, name: str, order=None, sequences: int = 0
) -> list[Candidate]:
    """One starter plan per layout the model takes: init_plan's, whose mesh keeps every dim asked for.
    `sequences`: per step over every replica, which a pipelined layout's micro-batches split (0: none
    weighed)."""
    from ..compiler.predict import stacked_experts
    from ..compiler.starter import attention_patterns, unpipelinable

    stacks = block_stacks(model, order)
    experts = any(stacked_experts(m) for m in model.modules())
    attention = bool(attention_patterns(model, stacks)[0])
    pipelines = tuple(pp for pp in PIPELINES if sequences and unpipelinable(model, stacks, pp) is None)
    found = []
    for layout in layouts(model, world, gpus_per_node, experts, attention, pipelines):
        count = microbatches(layout, sequences // (layout.dp * layout.ep)) if layout.pp > 1 else None
        if layout.pp > 1 and count is None:
            continue
        text = _written(model, layout, name, order, count)
        if _keeps(text, layout):
            found.append(Candidate(layout, text, microbatches=count))
    return found


def _written(model: nn.Module, layout: Layout, name: str, order, count: int | None, drops=None) -> str:
    """init's starter for `layout` (`count` micro-batches where it pipelines)."""
    kept = dict(tp=layout.tp, dp=layout.dp, ep=layout.ep, cp=layout.cp, pp=layout.pp, microbatches=count)
    return init_plan(model, name=name, order=order, drops=drops, **kept)


@frozen
class Settling:
    """A layout's starter to settle in a worker process (`settled`)."""

    base: Candidate
    model_file: object  # a runtime.modelfile.ModelFile, pickled by path
    world: int
    name: str
    order: object  # compiler.trace.Order


#: The source name of the plans the search settles (their diagnostics point into it).
SETTLING = "<search>"


def settled(task: Settling) -> Candidate | None:
    """`task.base` (a layout's starter) with what lint's simulated step at the search's world finds cannot
    run left out, as `init` leaves it out (compiler.dropping.settle); None where a dim of the layout did not
    survive (no rule left to shard over tp, say): that layout is then no candidate."""
    from ..compiler.dropping import settle
    from ..explain.linting import read_and_linted
    from ..frontend.source import Source

    layout, model = task.base.layout, task.model_file.build_on_meta()

    def written(drops) -> str:
        return _written(model, layout, task.name, task.order, task.base.microbatches, drops)

    def linted(text: str):
        return read_and_linted(Source(SETTLING, text), model, task.model_file, task.world, task.order)

    text, *_ = settle(written, linted, SETTLING)
    return evolve(task.base, text=text) if _keeps(text, layout) else None


def _keeps(text: str, layout: Layout) -> bool:
    """Whether the plan `text`'s mesh keeps every dim of `layout` beyond data parallelism."""
    mesh = next(line for line in text.splitlines() if line.startswith("mesh "))
    return all(size == 1 or f"{dim}={size}" in mesh for dim, size in layout.extra())


def with_options(
    base: Candidate, model: nn.Module, checkpoint: str, reshard: bool, compiled: bool, offload: bool = False
) -> Candidate:
    """`base` with activation checkpointing of its stacks' blocks, `reshard_after_forward = false` on its
    fully_shard block where not `reshard`, `compile` of each stack's blocks and of the loss, and `offload =
    cpu` on its fully_shard block (parameters, gradients and optimizer states in host memory)."""
    lines = base.text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("fully_shard on "))
    end = next(i for i in range(start, len(lines)) if lines[i] == "}")
    stacks = [line.strip().removeprefix("each ").removesuffix(".*") for line in lines[start:end]]
    stacks = [s for s in stacks if _is_stack(model, s)]
    inside = ([] if reshard else ["    reshard_after_forward = false"]) + (["    offload = cpu"] if offload else [])
    after = []
    if checkpoint != "none" and stacks:
        after += ["", "# Activation checkpointing: each block's activations recomputed in the backward."]
        after += [f"checkpoint {_blocks(model, stack, checkpoint)}" for stack in stacks]
    if compiled and stacks:
        after += ["", "# torch.compile of each block, and of the loss."]
        after += [f"compile {stack}.*" for stack in stacks] + ["compile loss"]
    text = "\n".join([*lines[:end], *inside, lines[end], *after, *lines[end + 1 :]])
    return evolve(base, text=text, checkpoint=checkpoint, reshard=reshard, compiled=compiled, offload=offload)


def _is_stack(model: nn.Module, name: str) -> bool:
    try:
        stack = model.get_submodule(name)
    except AttributeError:
        return False
    return isinstance(stack, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) and len(stack) > 0


def _blocks(model: nn.Module, stack: str, checkpoint: str) -> str:
    """The pattern of the blocks of `stack` to checkpoint: every block, or every other one (the even
    indices; a stack of one block: that block)."""
    if checkpoint == "every":
        return f"{stack}.*"
    names = list(model.get_submodule(stack)._modules)
    chosen = names[::2] or names
    return f"{stack}.{{{','.join(chosen)}}}" if len(chosen) > 1 else f"{stack}.{chosen[0]}"
