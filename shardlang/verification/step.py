"""One training step of the sharded model, written once: what lint rehearses on fake tensors, what explain
measures, what the comms check counts, what the gradients check trains and what localisation replays.

A step has five phases, each a method, so that a caller can watch, stop or time between them
(docs/checks.md, "inputs and loss"):

- inputs: a data-parallel replica's whole batch (the model file's `example_input`, seeded by step and
  replica), and this rank's share of it: the whole batch, or its slice along D under the gradients check's
  `input = shard(D)`;
- forward: the sharded model on that share;
- whole: the output as the loss takes it: a slice gathered (`output = shard(D)`), a DTensor kept as it is
  (loss_parallel), each rank's shard of the sequence gathered (`context_parallel(output = local)`);
- loss: the model file's `loss(output, inputs)`, or the sum of the output, inside loss_parallel's context
  where the plan declares it, compiled where the plan says `compile loss`;
- backward: inside loss_parallel's context.

A pipelined plan runs forward and backward in torch's schedule, microbatch by microbatch; its last stage
takes the loss through `stage_loss`, the same whole and loss phases.

Every phase a step ran is noted once in `ran`, in order, as a line that says how it ran: the gradients
check reports them, and a test holds lint's rehearsal to the same lines as apply's check. How the loss is
compiled is kept apart (`compiled_by`): a simulated world compiles nothing, explain models the compiler,
a real run compiles.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.distributed.tensor import DTensor, Shard

from ..frontend import ir
from . import layout as lay


def not_compiled(loss: Callable, **options) -> Callable:
    """The loss as it is: how a simulated world "compiles" it (apply's SIMULATED mode compiles nothing)."""
    return loss


@attrs.define
class Step:
    """One training step of `ctx`'s sharded model (see the module docstring)."""

    ctx: Any
    where: lay.Layout
    #: The gradients check's `input=` and `output=` layouts (None: whole).
    input_layout: Any = None
    output_layout: Any = None
    #: Whether modules the plan compiles run eagerly: for callers that watch modules with hooks or a
    #: dispatch mode, which cannot run inside compiled code (the same modules, hooks and collectives).
    eagerly: bool = False
    #: How a `compile loss` is compiled: `compile_with(loss, **options)`; None is torch.compile.
    compile_with: Callable | None = None
    #: Under `context_parallel(output = local)`, the loss on each rank's shard of the output against its
    #: shard of the inputs, as a training loop takes it (explain's costs), instead of on the sequences
    #: gathered whole (the checks compare the loss with the unsharded model's).
    loss_on_shards: bool = False
    ran: list[str] = attrs.field(factory=list)
    _shared: tuple | None = attrs.field(default=None, init=False)

    @classmethod
    def of(cls, ctx, **options) -> Step:
        gradients = next((c for c in ctx.plan.checks if c.name == "gradients"), None)
        given = gradients.get if gradients is not None else (lambda _: None)
        return cls(ctx, lay.layout(ctx), given("input"), given("output"), **options)

    @property
    def plan(self) -> ir.Plan:
        return self.ctx.plan

    @property
    def compiled_by(self) -> str | None:
        """How the loss is compiled: None where the plan does not compile it."""
        if self.plan.compile_loss is None:
            return None
        if self.compile_with is None:
            return "torch.compile"
        return "not compiled (a simulated world)" if self.compile_with is not_compiled else "modelled"

    # -- inputs

    def batch(self, step: int = -1, size: int | None = None, replica: int | None = None) -> tuple:
        """One data-parallel replica's whole inputs at training step `step` (-1: a step no training step
        uses), `size` long (default: twice the TP size); this rank's replica by default."""
        size = size if size is not None else 2 * max(self.where.tp_size, 1)
        replica = self.where.replica if replica is None else replica
        return lay.replica_inputs(self.ctx, step, replica, size)

    def share(self, full: tuple) -> tuple:
        """This rank's share of the whole inputs `full` (the same tensors each time it is asked for the
        same `full`: explain's memory trackers count them once)."""
        if self._shared is not None and self._shared[0] is full:
            return self._shared[1]
        sliced = isinstance(self.input_layout, ir.Shard) and self.where.tp_size > 1
        self._note(f"inputs: each TP rank's slice along dim {self.input_layout.dim}" if sliced else "inputs: whole")
        self._shared = (full, lay.local_inputs(full, self.where, self.input_layout))
        return self._shared[1]

    # -- phases

    def forward(self, model: torch.nn.Module, full: tuple) -> Any:
        inputs = self.share(full)
        self._note("forward")
        with self._eager():
            return model(*inputs)

    def whole(self, output: Any) -> Any:
        """The output as the loss takes it (see the module docstring): a local slice (`output = shard(D)`)
        is gathered differentiably, so that each rank's gradient is its own slice."""
        if self._local_sequences() and self.loss_on_shards:
            self._note("whole: each rank's shard of the sequence")
            return output
        if self._local_sequences():
            return self._sequences_whole(output, self.ctx.model)
        if isinstance(output, DTensor):
            self._note("whole: a DTensor, as it is")
            return output
        if not isinstance(self.output_layout, ir.Shard) or self.where.tp_size == 1:
            self._note("whole: as returned")
            return output
        self._note(f"whole: gathered along dim {self.output_layout.dim} over the TP ranks")
        mesh = lay.tp_mesh(self.ctx, self.where)
        return DTensor.from_local(output, mesh, [Shard(self.output_layout.dim)], run_check=False).full_tensor()

    def loss(self, whole: Any, full: tuple) -> torch.Tensor:
        against = full
        if self.loss_on_shards and self._local_sequences():
            from ..runtime.context import along_sequence, context_shard

            against = along_sequence(full, lambda x: context_shard(self.ctx.model, x))[0]
        self._note(self._loss_line())
        with lay.loss_context(self.plan):
            return lay.loss(self.ctx, whole, against, sharded=True, compile_with=self.compile_with)

    def backward(self, loss: torch.Tensor) -> None:
        self._note("backward" + (" under loss_parallel" if self.plan.loss_parallel is not None else ""))
        with lay.loss_context(self.plan), self._eager():
            loss.backward()

    def run(self, model: torch.nn.Module, full: tuple) -> torch.Tensor:
        """Every phase, on `model` and the whole inputs `full`: the loss."""
        return self.finish(self.forward(model, full), full)

    def finish(self, output: Any, full: tuple) -> torch.Tensor:
        """The phases after the forward, on its `output`: the loss."""
        loss = self.loss(self.whole(output), full)
        self.backward(loss)
        return loss

    # -- pipelines

    def stage_loss(self, last: torch.nn.Module, output: Any, inputs: tuple) -> torch.Tensor:
        """A pipeline's last stage (`last`): the whole and loss phases on one microbatch's output (its
        model output rebuilt) and inputs."""
        if self._local_sequences():
            output = self._sequences_whole(output, last)
        else:
            self._note("whole: as returned")
        return self.loss(output, inputs)

    def scheduled(self, schedule_step: Callable, full: tuple, microbatches: int) -> Any:
        """A pipelined plan's step through `schedule_step` (torch's schedule, or explain's stage by stage),
        on this rank's share of `full` in `microbatches` microbatches."""
        inputs = self.share(full)
        self._note(f"forward and backward: a pipeline schedule, {microbatches} microbatches")
        before, self.ctx.stepping = self.ctx.stepping, self
        try:
            return schedule_step(inputs)
        finally:
            self.ctx.stepping = before

    # --

    def _loss_line(self) -> str:
        given = "the model file's loss" if self.ctx.model_file.loss is not None else "the sum of the output"
        return f"loss: {given}" + (" under loss_parallel" if self.plan.loss_parallel is not None else "")

    def _local_sequences(self) -> bool:
        """Whether the model returns each cp rank's shard of the sequence (`context_parallel(output = local)`)."""
        cp = self.plan.context_parallel
        return cp is not None and not cp.whole_output

    def _sequences_whole(self, output: Any, module: torch.nn.Module) -> Any:
        """`module`'s (the model's, or a pipeline's last stage's) sequence shards gathered whole."""
        self._note("whole: sequences gathered over cp")
        return lay.sequences_whole(self.ctx, output, module)

    def _note(self, line: str) -> None:
        if line not in self.ran:
            self.ran.append(line)

    def _eager(self):
        return lay.modules_eagerly(self.plan) if self.eagerly else contextlib.nullcontext()
