"""Plan + resolution -> program: the torch calls in the order of docs/language.md §4.4, whatever the plan's order.

meshes -> (rank 0's values kept) -> parallelize / distribute -> re-tie -> checkpoint -> compile ->
fully_shard and replicate units (children first, root last) -> materialise -> sync -> move leftovers.

With a resolution (a model) every step names its module; without one (`plan.to_python()`, `compile`
without MODEL) steps name the targets to match when the program runs, and mesh dims left `auto`
are sized from the world size then.
"""

from __future__ import annotations

from collections import defaultdict

from ..frontend import ir
from . import program as p
from .devices import mesh_device
from .float32 import FLOAT32, Float32Unit, float32_units
from .predict import owned, packs_for_fsdp
from .resolve import Resolution, UnitMatch
from .styles import OURS, Constructor, Reference, constructor

FSDP = "torch.distributed.fsdp"


def lower(plan: ir.Plan, resolution: Resolution | None, world_size: int | None) -> p.Program:
    steps: list[p.Step] = [
        p.MakeMesh(
            m.name, m.device, m.shape(world_size) if world_size else tuple(d.size for d in m.dims), m.dim_names, m.span
        )
        for m in plan.meshes
    ]
    if plan.init.mode == "rank0":
        steps.append(p.TakeRank0Values(plan.init.span))
    if plan.pipeline is not None:
        steps.append(_split(plan, resolution, world_size))
    steps += _parallelize(plan, resolution)
    if plan.parallelize:
        ties = _ties(resolution) if resolution is not None else None
        if ties is None or ties:
            steps.append(p.Retie(ties))
    cp = plan.context_parallel
    if cp is not None:
        patterns_ = tuple(str(t) for t in cp.targets)
        steps.append(p.ContextParallel(patterns_, cp.mesh, cp.load_balance, cp.span, cp.whole_output))
    origin = plan.checkpoint[0].span if plan.checkpoint else None
    if resolution is not None:
        steps += [p.Checkpoint(fqn, origin) for fqn in resolution.checkpoint]
        steps += [p.Compile(fqn, c.options, c.span) for fqn, c in resolution.compiled]
        steps += _units(plan, resolution)
    else:
        steps += [p.Checkpoint(p.Matching(str(target)), target.span) for target in plan.checkpoint]
        steps += [p.Compile(p.Matching(str(c.target)), c.options, c.span) for c in plan.compiles]
        for block in plan.units:
            for unit in block.units:
                also = tuple(p.Matching(str(t)) for t in unit.more)
                steps.append(_unit(plan, block, unit, p.Matching(str(unit.target)), also))
            if block.root:
                steps.append(_unit(plan, block, None, p.Matching("root")))
    device = _device(plan)
    if plan.init.mode == "meta":
        steps.append(p.InitOnMesh(device, plan.init.method, plan.init.span))
    elif plan.init.mode == "rank0":
        steps.append(p.LoadFromRank0(device, plan.init.span))
    steps += [p.Sync(s.mesh, s.span) for s in plan.syncs]
    if plan.init.mode in ("meta", "rank0") and device != "cpu":  # after the syncs: they broadcast on the GPU
        steps += [
            p.OffloadToCpu(module, s.origin)
            for s in steps
            if isinstance(s, p.FullyShard) and any(k == "offload_policy" for k, _ in s.kwargs)
            for module in (s.module, *s.also)
        ]
    if plan.init.mode == "cpu" and device != "cpu":
        steps.append(p.MoveToDevice(device, plan.init.span))
    return p.Program(plan, world_size, tuple(steps))


def _split(plan: ir.Plan, resolution: Resolution | None, world_size: int | None) -> p.Step:
    """The pipeline's split. It needs the module tree: a program lowered without a model cannot print one."""
    pipeline = plan.pipeline
    stages = resolution.stages if resolution is not None else None
    if stages is None or world_size is None:
        raise ValueError("a pipelined plan is lowered for a model and a world size")
    (dim,) = pipeline.mesh.dims
    pp = dict(zip(plan.mesh(pipeline.mesh.mesh).dim_names, plan.mesh(pipeline.mesh.mesh).shape(world_size)))[dim]
    dropped = tuple(stages.dropped(s) for s in range(stages.count))
    return p.SplitStages(pipeline.mesh, stages.blocks, dropped, pipeline.stage_ranks(pp), pipeline.span)


def _device(plan: ir.Plan) -> str:
    """The device the model lives on: that of the first mesh a statement uses (SL208 keeps them alike)."""
    used = (
        [b.mesh.mesh for b in plan.parallelize] + [u.mesh.mesh for u in plan.units] + [s.mesh.mesh for s in plan.syncs]
    )
    return plan.mesh(used[0]).device if used else plan.meshes[0].device if plan.meshes else "auto"


def _parallelize(plan: ir.Plan, resolution: Resolution | None) -> list[p.Step]:
    """Per block: one parallelize_module call per scope for the built-in ParallelStyles, then the
    distribute and user-style calls, one per module (their order among modules does not matter).
    Without a model, one call per rule on the modules it matches."""
    steps: list[p.Step] = []
    for b, block in enumerate(plan.parallelize):
        if resolution is None:  # the same order as with a model: parallelize_module calls, then the others
            scope = str(block.scope) if block.scope is not None else None
            calls = [_rule(r, p.Matching(str(r.target), scope), block.mesh) for r in block.rules]
            steps += sorted(calls, key=_call_order)
            continue
        by_scope: dict[str, list] = defaultdict(list)
        calls: list[p.Step] = []
        for m in (m for m in resolution.rules if m.block == b):
            style = m.rule.style
            if style.use is None and style.name != "distribute":
                by_scope[m.scope].append((m.relative, constructor(style)))
            else:
                calls.append(_rule(m.rule, m.fqn, block.mesh))
        steps += [p.Parallelize(scope, block.mesh, tuple(styles), block.span) for scope, styles in by_scope.items()]
        steps += sorted(calls, key=_call_order)
    return steps


def _call_order(step: p.Step) -> tuple:
    """parallelize_module calls first (in their rules' order), then distribute and user-style calls."""
    if isinstance(step, p.Parallelize):
        return (0, "", 0, 0)
    return (1, type(step).__name__, step.origin.line, step.origin.col)


def _rule(rule: ir.Rule, module: p.Module, mesh: ir.MeshRef) -> p.Step:
    style = rule.style
    if style.use is not None:
        return p.UserStyle(module, mesh, style.name, constructor(style).kwargs, rule.span)
    if style.name == "distribute":
        output = style.get("output", ir.Local())
        return p.Distribute(
            module,
            mesh,
            style.get("input", ir.Replicate()),
            None if isinstance(output, ir.Local) else output,
            rule.span,
        )
    return p.Parallelize(module, mesh, (("", constructor(style)),), rule.span)


def _ties(resolution: Resolution) -> tuple[tuple[str, ...], ...]:
    groups: dict[int, list[str]] = defaultdict(list)
    for fqn, _, _, tensor in owned(resolution.modules, buffers=False):
        groups[id(tensor)].append(fqn)
    return tuple(tuple(names) for names in groups.values() if len(names) > 1)


def _units(plan: ir.Plan, resolution: Resolution) -> list[p.Step]:
    """The fully_shard and replicate units, each after the float32 units of the modules inside it that the
    model keeps in float32 (compiler.float32), which FSDP2 must see first to leave out of it."""
    kept = float32_units(plan, resolution)
    steps: list[p.Step] = []
    for u in resolution.units:
        steps += [_float32_unit(plan, k) for k in kept if k.unit is u]
        steps.append(_unit(plan, plan.units[u.block], u.unit, u.fqn, u.also))
    return steps


def _float32_unit(plan: ir.Plan, kept: Float32Unit) -> p.Step:
    """A float32 unit inside `kept.unit`: its options, but parameters in float32, gradients reduced in its
    `reduce`, and inputs taken as they come (in the outer unit's compute dtype); its gradients divided as the
    outer unit's (the experts' unit over dp, dividing by dp x ep: Ergo's per-expert norms)."""
    block = plan.units[kept.unit.block]
    outer = kept.unit.option(block, "mixed_precision")
    policy = ir.MixedPrecision(param=FLOAT32, reduce=outer.reduce, cast_forward_inputs=False)

    def get(name: str):
        return policy if name == "mixed_precision" else kept.unit.option(block, name)

    origin = kept.unit.unit.span if kept.unit.unit is not None else block.span
    kwargs = _fsdp_kwargs(plan, block, get)
    return p.FullyShard(kept.module, block.mesh, kwargs, origin, divide_by=block.divide_by, why=kept.why())


def _unit(
    plan: ir.Plan, block: ir.Units, unit: ir.Unit | None, module: p.Module, also: tuple[p.Module, ...] = ()
) -> p.Step:
    """One fully_shard or replicate unit (`unit` None: the block's root unit); `also`, the other modules of
    a `unit` over several (static checks keep those to fully_shard)."""
    match = UnitMatch(0, "", unit)
    origin = unit.span if unit is not None else block.span
    if block.kind == "replicate":
        return p.Replicate(module, block.mesh, match.options(block), origin)
    if match.kind(block) == "replicate":  # FSDP1's NO_SHARD is plain data parallelism
        return p.Replicate(module, block.mesh, (), origin)
    kwargs = _fsdp_kwargs(plan, block, lambda name: match.option(block, name))
    together = unit is not None and unit.together and (bool(also) or isinstance(module, p.Matching))
    return p.FullyShard(module, block.mesh, kwargs, origin, also, together, block.divide_by)


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
    if packs_for_fsdp(plan):
        # FSDP shards a packed weight on dim 1: its Shard(0) of rows that TP took part by part would be
        # mislabelled (runtime.tpstyles.fsdp_shard_placement; predict._fsdp says the same)
        kwargs.append(("shard_placement_fn", Reference(f"{OURS}.fsdp_shard_placement")))
    if get("offload") == "cpu":
        # Pinned memory needs a GPU (an `auto` mesh is judged where the program is lowered).
        pin = mesh_device(plan.mesh(block.mesh.mesh).device) == "cuda"
        kwargs.append(
            ("offload_policy", Constructor(f"{FSDP}.CPUOffloadPolicy", () if pin else (("pin_memory", False),)))
        )
    return tuple(kwargs)
