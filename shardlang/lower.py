"""Plan + resolution -> program: the torch calls in the order of SPEC §4.4, whatever the plan's order.

meshes -> (rank 0's values kept) -> parallelize / distribute -> re-tie -> checkpoint ->
fully_shard and replicate units (children first, root last) -> materialise -> sync -> move leftovers.
"""

from __future__ import annotations

from collections import defaultdict

from . import plan as ir
from . import program as p
from .predict import owned
from .resolve import Resolution
from .styles import Constructor, constructor

FSDP = "torch.distributed.fsdp"


def lower(plan: ir.Plan, resolution: Resolution, world_size: int) -> p.Program:
    steps: list[p.Step] = [p.MakeMesh(m.name, m.device, m.shape(world_size), m.dim_names, m.span) for m in plan.meshes]
    if plan.init.mode == "rank0":
        steps.append(p.TakeRank0Values(plan.init.span))
    steps += _parallelize(plan, resolution)
    ties = _ties(resolution)
    if ties and plan.parallelize:
        steps.append(p.Retie(ties))
    steps += [p.Checkpoint(fqn, _checkpoint_origin(plan)) for fqn in resolution.checkpoint]
    steps += _units(plan, resolution)
    device = _device(plan)
    if plan.init.mode == "meta":
        steps.append(p.InitOnMesh(device, plan.init.method, plan.init.span))
    elif plan.init.mode == "rank0":
        steps.append(p.LoadFromRank0(device, plan.init.span))
    steps += [p.Sync(s.mesh, s.span) for s in plan.syncs]
    if plan.init.mode == "cpu" and device != "cpu":
        steps.append(p.MoveToDevice(device, plan.init.span))
    return p.Program(plan, world_size, tuple(steps))


def _device(plan: ir.Plan) -> str:
    """The device the model lives on: that of the first mesh a statement uses (SL208 keeps them alike)."""
    used = [b.mesh.mesh for b in plan.parallelize] + [u.mesh.mesh for u in plan.units] + [s.mesh.mesh for s in plan.syncs]
    return plan.mesh(used[0]).device if used else plan.meshes[0].device if plan.meshes else "auto"


def _checkpoint_origin(plan: ir.Plan):
    return plan.checkpoint[0].span if plan.checkpoint else None


def _parallelize(plan: ir.Plan, resolution: Resolution) -> list[p.Step]:
    """Per block: one parallelize_module call per scope for the built-in ParallelStyles, then the
    distribute and user-style calls, one per module (their order among modules does not matter)."""
    steps: list[p.Step] = []
    for b, block in enumerate(plan.parallelize):
        by_scope: dict[str, list] = defaultdict(list)
        calls: list[p.Step] = []
        for m in (m for m in resolution.rules if m.block == b):
            style = m.rule.style
            if style.use is not None:
                calls.append(p.UserStyle(m.fqn, block.mesh, style.name, constructor(style).kwargs, m.rule.span))
            elif style.name == "distribute":
                output = style.get("output", ir.Local())
                calls.append(p.Distribute(m.fqn, block.mesh, style.get("input", ir.Replicate()),
                                          None if isinstance(output, ir.Local) else output, m.rule.span))  # fmt: skip
            else:
                by_scope[m.scope].append((m.relative, constructor(style)))
        steps += [p.Parallelize(scope, block.mesh, tuple(styles), block.span) for scope, styles in by_scope.items()]
        steps += sorted(calls, key=lambda c: (type(c).__name__, c.origin.line, c.origin.col))
    return steps


def _ties(resolution: Resolution) -> tuple[tuple[str, ...], ...]:
    groups: dict[int, list[str]] = defaultdict(list)
    for fqn, _, _, tensor in owned(resolution.modules, buffers=False):
        groups[id(tensor)].append(fqn)
    return tuple(tuple(names) for names in groups.values() if len(names) > 1)


def _units(plan: ir.Plan, resolution: Resolution) -> list[p.Step]:
    steps: list[p.Step] = []
    for unit in resolution.units:
        block = plan.units[unit.block]
        get = (lambda name, default=None: unit.option(block, name, default))  # noqa: E731
        origin = unit.unit.span if unit.unit is not None else block.span
        if block.kind == "replicate":
            steps.append(p.Replicate(unit.fqn, block.mesh, unit.options(block), origin))
        elif unit.kind(block) == "replicate":  # FSDP1's NO_SHARD is plain data parallelism
            steps.append(p.Replicate(unit.fqn, block.mesh, (), origin))
        else:
            steps.append(p.FullyShard(unit.fqn, block.mesh, _fsdp_kwargs(plan, block, get), origin))
    return steps


def _fsdp_kwargs(plan: ir.Plan, block: ir.Units, get) -> tuple:
    kwargs = []
    reshard = get("reshard_after_forward")
    strategy = get("strategy")
    if reshard is None and strategy is not None:
        reshard = strategy != "shard_grad_op"
    if reshard is not None:
        kwargs.append(("reshard_after_forward", reshard))
    mp = get("mixed_precision")
    if mp is not None:
        fields = {"param_dtype": mp.param, "reduce_dtype": mp.reduce, "output_dtype": mp.output}
        args = tuple((k, v) for k, v in fields.items() if v is not None)
        if not mp.cast_forward_inputs:
            args += (("cast_forward_inputs", False),)
        kwargs.append(("mp_policy", Constructor(f"{FSDP}.MixedPrecisionPolicy", args)))
    if get("offload") == "cpu":
        # Pinned memory needs a GPU; on a CPU mesh the policy still moves nothing but keeps the flow.
        pin = plan.mesh(block.mesh.mesh).device != "cpu"
        kwargs.append(("offload_policy", Constructor(f"{FSDP}.CPUOffloadPolicy", () if pin else (("pin_memory", False),))))
    return tuple(kwargs)
