"""The library's verbs: `load`, `loads`, `verify`, and the `Plan` facade whose methods call the stages.

The IR (frontend.ir.Plan) is data only and imports no later stage; this module is where the stages
meet. It imports the torch-free front end at the top and every other stage inside the method that
needs it, so that `import shardlang` (and `shardlang lint`) stays free of torch.distributed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from attrs import frozen

from .frontend import ir
from .frontend.diagnostics import Diagnostic, PlanError
from .frontend.read import read_file, read_source
from .frontend.source import Source
from .frontend.static_checks import check_world


@frozen
class Plan(ir.Plan):
    """A checked plan (the IR, unchanged) with the library's verbs. What `shardlang.load` returns."""

    @classmethod
    def of(cls, plan: ir.Plan) -> Plan:
        """The same plan as a facade."""
        return plan if isinstance(plan, cls) else cls(**{f.name: getattr(plan, f.name) for f in attrs.fields(ir.Plan)})

    def with_world(self, world_size: int) -> list[Diagnostic]:
        """SL105 diagnostics if the meshes cannot be laid over `world_size` ranks."""
        return check_world(self, world_size)

    def lint(self, model: Any, world_size: int, rules: Any = None) -> list[Diagnostic]:
        """Every diagnostic of this plan against `model` (built on the meta device is enough) at `world_size`.
        `rules`: the lint rules to run (`shardlang.compiler.rules.RULES` by default; each a `Rule`): a
        subset, or the defaults with your own added, `rules=(*RULES, my_rule)`."""
        from .compiler.lint import lint
        from .compiler.rules import RULES

        found = lint(self, model, world_size, rules=RULES if rules is None else rules)
        return [*self.diagnostics, *found.diagnostics]

    def build(self, build_model: Any) -> Any:
        """Call `build_model()` where this plan's `init` says: on meta (`meta`; `rank0` except on rank 0),
        on the CPU (`cpu`, rank 0 of `rank0`) or on the mesh device (`auto`)."""
        from .runtime.apply import build_for_plan

        return build_for_plan(self, build_model)

    def apply(self, model: Any) -> Any:
        """Shard `model` in place by this plan; call on every rank inside an initialised process group.
        Raises PlanError (nothing changed) if the plan does not fit the model or a step fails."""
        from .runtime.apply import apply_plan

        return apply_plan(self, model).model

    def explain(
        self,
        model: Any,
        world_size: int,
        rank: int = 0,
        example_input: Any = None,
        loss: Any = None,
        full_step: bool = False,
        batch: int | None = None,
        gpu: str = "h100",
        fit: int | None = None,
    ) -> Any:
        """What every rank of a `world_size` world holds (and, given `example_input`, sends in one
        training step, its peak memory with `batch` per replica and its time on `gpu`), in a simulated
        world in one process; `model` on the meta device is enough. `full_step`: run the step on every
        block of a repeated stack, not on 2, 3 and 4 of them; `fit` (bytes): the largest batch that fits."""
        import copy
        import functools

        from .explain.options import ExplainOptions
        from .explain.simulate import explain
        from .explain.timing import hardware
        from .runtime.modelfile import ModelFile

        options = ExplainOptions(world_size, rank, full_step=full_step, batch=batch, hardware=hardware(gpu), fit=fit)
        # picklable, for a simulation in a fresh process (inside a process group)
        build = functools.partial(copy.deepcopy, model)
        model_file = ModelFile("library", build, example_input, loss) if example_input is not None else None
        return explain(self, model, options, model_file)

    def loss(self, loss: Any) -> Any:
        """The loss function to train the sharded model with: `loss` itself, or compiled as the plan's
        `compile loss (OPTIONS)` says (the same compiled function on every call). Under `loss_parallel`,
        call it and its backward inside `torch.distributed.tensor.parallel.loss_parallel()`."""
        if self.compile_loss is None:
            return loss
        from .runtime.compiled import compiled_loss

        return compiled_loss(loss, **dict(self.compile_loss.options))

    def context_shard(self, model: Any, tensor: Any, dim: int = 1) -> Any:
        """Under `context_parallel (output = local)`: this rank's shard of `tensor` along its sequence dim,
        as the sharded `model` splits its inputs (the labels to take the loss against)."""
        from .runtime.context import context_shard

        return context_shard(model, tensor, dim)

    def to_python(self, model: Any = None, world_size: int | None = None) -> str:
        """The program as plain torch code; resolved against `model` (any device, meta is enough) if given."""
        from .emit.python import compile_python

        return compile_python(self, model, world_size)


def load(path: str | Path, params: Mapping[str, Any] | None = None, *, world_size: int | None = None) -> Plan:
    """Read, parse and check a plan file. `params` override its `param`s; `world_size` resolves `auto` dims."""
    plan, found, sources = read_file(path, params, world_size)
    if plan is None:
        raise PlanError(found, sources)
    return Plan.of(plan)


def loads(
    text: str, params: Mapping[str, Any] | None = None, *, name: str = "<string>", world_size: int | None = None
) -> Plan:
    """Parse and check plan text, as `load` does for a file."""
    source = Source(name, text)
    plan, found = read_source(source, params, world_size)
    if plan is None:
        raise PlanError(found, {name: source})
    return Plan.of(plan)


def verify(
    plan: ir.Plan,
    build_model,
    example_input=None,
    loss=None,
    *,
    checks: tuple[str, ...] | None = None,
    nproc: int | None = None,
    seed: int = 0,
):
    """Apply `plan` to a model from `build_model` and run its checks (or `checks`); the report
    (shardlang.launch.report.Report).

    Inside an initialised process group every rank calls this and gets the same report. Outside one,
    it starts `nproc` local workers (gloo; the functions must be importable, e.g. module-level)."""
    import torch.distributed as dist

    from .launch.job import Job, run
    from .launch.workers import WorkerPool
    from .runtime.modelfile import ModelFile

    wanted = (
        plan.checks
        if checks is None
        else tuple(next((c for c in plan.checks if c.name == n), ir.Check(n, ())) for n in checks)
    )
    job = Job(plan, {}, None, None, wanted, seed, ModelFile("library", build_model, example_input, loss))
    if dist.is_available() and dist.is_initialized():
        return run(job)
    if nproc is None:
        nproc = plan.fixed_world_size()
    with WorkerPool(nproc) as pool:
        return pool.run(run, job)[0]
