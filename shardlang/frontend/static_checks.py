"""Static checks that need no model (SL101-SL108), building the typed plan IR from the syntax tree.

Every statement is checked and every problem collected, so one run reports them all. Values are given
their types (layouts, dtypes, booleans...) by the schema of the place they stand in (schema.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from . import ir
from . import syntax as s
from .desugar import expert_units
from .diagnostics import (
    SL100,
    SL101,
    SL102,
    SL103,
    SL104,
    SL105,
    SL106,
    SL107,
    SL108,
    SL215,
    SL216,
    Code,
    Diagnostic,
    did_you_mean,
)
from .parse import parse_literal
from .patterns import bad_segment
from .schema import (
    BLOCK_OPTIONS,
    CHECKS,
    COMPILE_OPTIONS,
    CONTEXT_OPTIONS,
    DEVICES,
    INIT_MODES,
    MIXED_PRECISION,
    PIPELINE_OPTIONS,
    STYLES,
    UNIT_OPTIONS,
    Convert,
    Invalid,
    bare_word,
    choice,
    integer,
    passthrough,
)
from .source import Source, Span


def check(
    module: s.Module,
    source: Source,
    params: Mapping[str, Any] | None = None,
    world_size: int | None = None,
) -> tuple[ir.Plan | None, list[Diagnostic]]:
    """Check a parsed plan; return the typed plan (None if there were errors) and every diagnostic."""
    checker = _Checker(source)
    plan = checker.run(module, params or {})
    if plan is not None:
        plan, found = expert_units(plan)
        checker.diagnostics += found
    if plan is not None and world_size is not None:
        checker.diagnostics += check_world(plan, world_size)
    if any(d.is_error for d in checker.diagnostics):
        return None, checker.diagnostics
    return plan, checker.diagnostics


def check_world(plan: ir.Plan, world_size: int) -> list[Diagnostic]:
    """SL105: every mesh must cover exactly `world_size` ranks, its `auto` dim taking what is left."""
    found = []
    for mesh in plan.meshes:
        fixed = mesh.fixed_size
        shape = " x ".join(f"{d.name}={d.size if d.size is not None else 'auto'}" for d in mesh.dims)
        auto = [d for d in mesh.dims if d.size is None]
        if auto and world_size % fixed:
            message = f"mesh '{mesh.name}' [{shape}] does not fit a world of {world_size}: {fixed} does not divide {world_size}"
            found.append(Diagnostic(SL105, message, mesh.span, (f"pick sizes whose product divides {world_size}",)))
        elif not auto and fixed != world_size:
            message = f"mesh '{mesh.name}' [{shape}] has {fixed} ranks but the world has {world_size}"
            found.append(Diagnostic(SL105, message, mesh.span, ("make one dim `auto` to fill the world",)))
    return found


class _Checker:
    def __init__(self, source: Source):
        self.source = source
        self.diagnostics: list[Diagnostic] = []
        self.params: dict[str, s.Value] = {}
        self.uses: dict[str, ir.Use] = {}
        self.meshes: dict[str, ir.Mesh] = {}

    def error(self, code: Code, message: str, span: Span | None, *help: str, label: str = "") -> None:
        self.diagnostics.append(Diagnostic(code, message, span, help, label))

    def convert(self, convert: Convert, value: s.Value) -> Any:
        """Resolve `$param` references, then type the value; None (and a diagnostic) if it does not fit."""
        value = self.resolve(value)
        if value is None:
            return None
        try:
            return convert(value)
        except Invalid as e:
            self.error(e.code, e.message, value.span, *e.help)
            return None

    def resolve(self, value: s.Value) -> s.Value | None:
        if isinstance(value, s.ParamRef):
            if value.name not in self.params:
                self.error(
                    SL104, f"undefined param '${value.name}'", value.span, *did_you_mean(value.name, self.params)
                )
                return None
            found = self.params[value.name]
            # Keep the use site's span, so that a bad value is reported where it is used.
            return attrs.evolve(found, span=value.span)
        if isinstance(value, s.Call):
            args = tuple(self.resolve(a) for a in value.args)
            return None if None in args else s.Call(value.name, args, value.span)
        if isinstance(value, s.Tuple):
            items = tuple(self.resolve(i) for i in value.items)
            return None if None in items else s.Tuple(items, value.span)
        if isinstance(value, s.Arg):
            inner = self.resolve(value.value)
            return None if inner is None else s.Arg(value.name, inner, value.span)
        return value

    def kwargs(
        self, args: tuple[s.Value | s.Arg, ...], schema: Mapping[str, Convert] | None, what: str, owner: str
    ) -> tuple:
        """Keyword arguments checked against `schema` (None: any name, passed through as is)."""
        typed, seen = [], {}
        for arg in args:
            if not isinstance(arg, s.Arg):
                self.error(SL102, f"{what} arguments are keywords, e.g. {owner}(name=value)", arg.span)
                continue
            name = arg.name.text
            if name in seen:
                self.twice(f"argument '{name}'", arg.name.span, seen[name])
                continue
            seen[name] = arg.span
            if schema is not None and name not in schema:
                known = ", ".join(schema) or "none"
                hint = did_you_mean(name, schema) or (f"{owner} takes: {known}",)
                self.error(SL101, f"unknown {what} argument '{name}' for {owner}", arg.name.span, *hint)
                continue
            value = self.convert(schema[name] if schema is not None else passthrough, arg.value)
            if value is not None:
                typed.append((name, value))
        return tuple(typed)

    # --- statements ---

    def run(self, module: s.Module, overrides: Mapping[str, Any]) -> ir.Plan | None:
        by_type: dict[type, list] = {}
        for statement in module.statements:
            by_type.setdefault(type(statement), []).append(statement)
        statements = lambda kind: by_type.get(kind, [])  # noqa: E731

        for version in statements(s.VersionStmt):
            if version.number.value != 1:
                self.error(
                    SL102,
                    f"unsupported language version {version.number.value}",
                    version.number.span,
                    "this shardlang reads `shardlang 1`",
                )
        self.unique(statements(s.VersionStmt), "the version header")
        self.declare_params(statements(s.ParamStmt), overrides)
        uses = [self.use(u) for u in statements(s.UseStmt)]
        meshes = [self.mesh(m) for m in statements(s.MeshStmt)]
        parallelize = [self.parallelize(p) for p in statements(s.ParallelizeStmt)]
        units = [self.units(u) for u in statements(s.UnitsStmt)]
        checkpoint = tuple(self.target(t) for c in statements(s.CheckpointStmt) for t in c.targets)
        compiled = [c for statement in statements(s.CompileStmt) for c in self.compile(statement)]
        losses = [c for c in compiled if isinstance(c, ir.CompileLoss)]
        self.unique(losses, "compile loss")
        self.unique(statements(s.InitStmt), "init")
        inits = [self.init(i) for i in statements(s.InitStmt)]
        syncs = [self.sync(x) for x in statements(s.SyncStmt)]
        self.unique(statements(s.LossParallelStmt), "loss_parallel")
        loss = statements(s.LossParallelStmt)
        checks = [c for v in statements(s.VerifyStmt) for c in self.verify(v)]
        self.unique_checks(checks)
        self.unique(statements(s.ContextParallelStmt), "context_parallel")
        contexts = [self.context_parallel(x) for x in statements(s.ContextParallelStmt)]
        self.unique(statements(s.PipelineStmt), "pipeline")
        pipelines = [self.pipeline(x) for x in statements(s.PipelineStmt)]
        if pipelines and pipelines[0] is not None:
            self.check_pipeline_dim(pipelines[0], parallelize, units, syncs, loss, checks, inits)

        if any(d.is_error for d in self.diagnostics):
            return None
        return ir.Plan(
            source=self.source,
            params=tuple((k, s.plain(v)) for k, v in self.params.items()),
            uses=tuple(uses),
            meshes=tuple(meshes),
            parallelize=tuple(parallelize),
            checkpoint=checkpoint,
            compiles=tuple(c for c in compiled if isinstance(c, ir.Compile)),
            compile_loss=losses[0] if losses else None,
            context_parallel=contexts[0] if contexts else None,
            units=tuple(units),
            init=inits[0] if inits else ir.Init("auto"),
            syncs=tuple(syncs),
            loss_parallel=loss[0].span if loss else None,
            pipeline=pipelines[0] if pipelines else None,
            checks=tuple(checks) if statements(s.VerifyStmt) else tuple(ir.Check(name, ()) for name in CHECKS),
            diagnostics=tuple(self.diagnostics),
        )

    def twice(self, what: str, span: Span, first: Span | None, did: str = "given", where: str = "") -> None:
        """SL103, in one wording: `what` {did} twice{where} at `span`, and the line of the first (`first`)."""
        at = (f"the first is at line {first.line}",) if first is not None else ()
        self.error(SL103, f"{what} is {did} twice{where}", span, *at)

    def unique(self, statements: list, what: str) -> None:
        for extra in statements[1:]:
            self.twice(what, extra.span, statements[0].span)

    def declare_params(self, params: list[s.ParamStmt], overrides: Mapping[str, Any]) -> None:
        for p in params:
            if p.name.text in self.params:
                self.twice(f"param '{p.name.text}'", p.name.span, self.params[p.name.text].span, "declared")
            elif isinstance(p.value, s.ParamRef):
                self.error(SL102, f"param '{p.name.text}' must be a literal, not another param", p.value.span)
            else:
                self.params[p.name.text] = p.value
        for name, value in overrides.items():
            if name not in self.params:
                hint = did_you_mean(name, self.params) or (f"params of this plan: {', '.join(self.params) or 'none'}",)
                self.error(SL104, f"no param named '{name}' to override", None, *hint)
                continue
            self.params[name] = parse_literal(value, self.params[name].span)

    def use(self, use: s.UseStmt) -> ir.Use:
        alias = use.alias.text
        if alias in self.uses:
            self.twice(f"'{alias}'", use.alias.span, self.uses[alias].span, "declared", " by use")
        elif alias in STYLES:
            # SPEC §12: a plan written before a built-in of this name existed keeps its meaning.
            self.error(
                SL108,
                f"'{alias}' is also a built-in style; this plan's rules naming it run `{use.path}`, not the built-in",
                use.alias.span,
                f"to use the built-in {alias}, remove this `use`; to keep this style, rename it after `as` to silence this",
            )
        if not all(part.isidentifier() for part in use.path.replace(":", ".").split(".")):
            self.error(
                SL102,
                f"'{use.path}' is not an import path",
                use.span,
                'write package.module.Name or "package.module:Name"',
            )
        self.uses[alias] = ir.Use(use.path, alias, use.span)
        return self.uses[alias]

    def mesh(self, mesh: s.MeshStmt) -> ir.Mesh:
        name = mesh.name.text
        if name in self.meshes:
            self.twice(f"mesh '{name}'", mesh.name.span, self.meshes[name].span, "declared")
        device = self.convert(choice(*DEVICES, what="device"), mesh.device) or "auto"
        dims, autos = [], []
        for arg in mesh.dims:
            if not isinstance(arg, s.Arg):
                self.error(SL102, "mesh dims are named, e.g. mesh world = cuda[dp=2, tp=4]", arg.span)
                continue
            if any(d.name == arg.name.text for d in dims):
                self.twice(f"mesh dim '{arg.name.text}'", arg.name.span, None, "declared", f" in mesh '{name}'")
                continue
            size = self.mesh_size(arg)
            if size == "auto":
                autos.append(arg)
                size = None
            dims.append(ir.MeshDim(arg.name.text, size, arg.span))
        for extra in autos[1:]:
            self.error(
                SL105,
                f"mesh '{name}' has more than one auto dim",
                extra.span,
                "at most one dim can take the rest of the world",
            )
        result = ir.Mesh(name, device, tuple(dims), mesh.span)
        self.meshes.setdefault(name, result)
        return result

    def mesh_size(self, arg: s.Arg) -> int | str | None:
        value = self.resolve(arg.value)
        if value is None:
            return None
        if bare_word(value) == "auto":
            return "auto"
        if isinstance(value, s.Int) and value.value >= 1:
            return value.value
        self.error(SL102, f"mesh dim '{arg.name.text}' must be a positive integer or auto, got {value}", value.span)
        return None

    def mesh_ref(
        self, ref: s.MeshRef, ndims: tuple[int, ...] = (), code: Code | None = None, what: str = ""
    ) -> ir.MeshRef:
        """Resolve `world`, `world.tp` or `world[dp, tp]`; `ndims` (if given) are the dimensionalities allowed."""
        name = ref.mesh.text
        mesh = self.meshes.get(name)
        if mesh is None:
            self.error(SL104, f"undefined mesh '{name}'", ref.mesh.span, *did_you_mean(name, self.meshes))
            return ir.MeshRef(name, (), ref.span)
        names = mesh.dim_names
        dims = names if ref.dims is None else tuple(d.text for d in ref.dims)
        for d in ref.dims or ():
            if d.text not in names:
                hint = did_you_mean(d.text, names) or (f"mesh '{name}' has dims {', '.join(names)}",)
                self.error(SL104, f"mesh '{name}' has no dim '{d.text}'", d.span, *hint)
        if len(set(dims)) != len(dims):
            self.error(SL102, f"{ref} names a dim twice", ref.span)
        elif ref.flat and what not in ("fully_shard", "replicate"):
            self.error(SL102, f"a flattened mesh ({ref}) is for fully_shard and replicate blocks", ref.span)
        elif ref.flat and [d for d in names if d in dims] != list(dims):
            order = "*".join(d for d in names if d in dims)
            self.error(SL102, f"{ref} flattens dims out of the mesh's order", ref.span, f"write {name}[{order}]")
        elif ndims and (1 if ref.flat else len(dims)) not in ndims:
            wanted = " or ".join(f"{n}-D" for n in ndims)
            self.error(
                code,
                f"{what} needs a {wanted} mesh, but {ref} is {len(dims)}-D",
                ref.span,
                f"name the dims to use, e.g. {name}.{names[-1]}" if len(names) > 1 else "",
            )
        return ir.MeshRef(name, dims, ref.span, flat=ref.flat)

    def target(self, target: s.Target) -> s.Target:
        bad = bad_segment(target.segments) if isinstance(target, s.Pattern) else None
        if bad is not None:
            self.error(
                SL100,
                f"'{bad}' is not a pattern segment",
                target.span,
                "a segment is a name, an integer, a glob (*, **, w*, layer?) or {a,b,...} of those",
            )
        return target

    def parallelize(self, block: s.ParallelizeStmt) -> ir.Parallelize:
        mesh = self.mesh_ref(block.mesh, (1,), SL107, "parallelize")
        scope = block.scope and self.target(block.scope)
        rules = tuple(ir.Rule(self.target(r.target), self.style(r.style), r.span) for r in block.rules)
        return ir.Parallelize(scope, mesh, rules, block.span)

    def style(self, call: s.Call) -> ir.Style:
        name = call.name.text
        if name in self.uses:  # before the built-ins: a `use` may take a built-in's name (SL108)
            return ir.Style(name, self.kwargs(call.args, None, "style", name), call.span, self.uses[name])
        if name in STYLES:
            style = ir.Style(name, self.kwargs(call.args, STYLES[name], "style", name), call.span)
            if name == "mla_kv_a_proj" and style.get("rope") is None:
                self.error(SL102, "mla_kv_a_proj needs rope=N", call.span, "N: the model config's qk_rope_head_dim")
            return style
        hint = did_you_mean(name, [*STYLES, *self.uses]) or (
            f"built-in styles: {', '.join(STYLES)}; declare others with `use package.module.Style as {name}`",
        )
        self.error(SL104, f"undefined style '{name}'", call.name.span, *hint)
        return ir.Style(name, (), call.span)

    def units(self, block: s.UnitsStmt) -> ir.Units:
        mesh = self.mesh_ref(block.mesh, (1, 2), SL106, block.kind)
        schema = UNIT_OPTIONS[block.kind]
        block_options = self.options(
            [i for i in block.items if isinstance(i, s.Option)], {**schema, **BLOCK_OPTIONS}, block.kind
        )
        root = dict(block_options).pop("root", True)
        block_options = tuple((k, v) for k, v in block_options if k != "root")
        units = []
        for item in (i for i in block.items if isinstance(i, (s.Each, s.UnitItem))):
            together = isinstance(item, s.UnitItem)
            if together and block.kind == "replicate":
                self.error(SL101, "`unit` is fully_shard's: a replicate unit wraps one module (use `each`)", item.span)
            own = self.options(item.options, schema, f"{'unit' if together else 'each'} of {block.kind}")
            first, *more = map(self.target, item.targets)
            units.append(ir.Unit(first, _merge(block_options, own), item.span, tuple(more), together))
        self.check_strategy(block, mesh, block_options, units)
        return ir.Units(block.kind, mesh, tuple(units), block_options, root, block.span)

    def compile(self, statement: s.CompileStmt) -> list[ir.Compile | ir.CompileLoss]:
        """An ir.Compile per module target, an ir.CompileLoss for `loss`, each with the statement's options."""
        options = self.options(statement.options, COMPILE_OPTIONS, "compile")
        return [
            ir.CompileLoss(options, t.span)
            if isinstance(t, s.LossTarget)
            else ir.Compile(self.target(t), options, statement.span)
            for t in statement.targets
        ]

    def options(
        self, options: list[s.Option] | tuple[s.Option, ...], schema: Mapping[str, Convert], where: str
    ) -> tuple:
        typed, seen = [], {}
        for option in options:
            name = option.name.text
            if name not in schema:
                hint = did_you_mean(name, schema) or (f"{where} options: {', '.join(schema)}",)
                if name == "root":
                    hint = ("root = false is a block option; it cannot be set per unit",)
                self.error(SL101, f"unknown option '{name}' in {where}", option.name.span, *hint)
                continue
            if name in seen:
                self.twice(f"option '{name}'", option.name.span, seen[name], "set")
                continue
            seen[name] = option.span
            if name == "mixed_precision":
                if option.args is None:
                    self.error(
                        SL102,
                        "mixed_precision takes arguments",
                        option.span,
                        "write mixed_precision(param=bf16, reduce=fp32)",
                    )
                    continue
                fields = dict(self.kwargs(option.args, MIXED_PRECISION, "mixed_precision", "mixed_precision"))
                typed.append((name, ir.MixedPrecision(**fields)))
            elif option.value is None:
                self.error(SL102, f"option '{name}' takes a value: {name} = ...", option.span)
            else:
                value = self.convert(schema[name], option.value)
                if value is not None:
                    typed.append((name, value))
        return tuple(typed)

    def check_strategy(self, block: s.UnitsStmt, mesh: ir.MeshRef, block_options: tuple, units: list[ir.Unit]) -> None:
        """FSDP1 `strategy` aliases: hybrid_shard needs a 2-D mesh; full_shard and shard_grad_op a 1-D one."""
        strategies = {dict(block_options).get("strategy")} | {u.get("strategy") for u in units}
        if "hybrid_shard" in strategies and len(mesh.dims) == 1:
            self.error(
                SL106,
                "strategy = hybrid_shard needs a 2-D mesh (replicate dim, shard dim)",
                mesh.span,
                f"write fully_shard on {mesh.mesh}[<replicate dim>, <shard dim>]",
            )

    def context_parallel(self, block: s.ContextParallelStmt) -> ir.ContextParallel:
        mesh = self.mesh_ref(block.mesh, (1,), SL107, "context_parallel")
        targets = tuple(self.target(i.target) for i in block.items if isinstance(i, s.Each))
        for options in (i.options for i in block.items if isinstance(i, s.Each) and i.options):
            self.error(SL101, "context_parallel's `each` takes no options", options[0].span)
        options = dict(
            self.options([i for i in block.items if isinstance(i, s.Option)], CONTEXT_OPTIONS, "context_parallel")
        )
        if not targets:
            self.error(SL102, "context_parallel names no attention module", block.span, "add `each PATTERN`")
        balancer, whole = options.get("load_balance", "headtail"), options.get("output") != "local"
        return ir.ContextParallel(mesh, targets, balancer, block.span, whole)

    def init(self, init: s.InitStmt) -> ir.Init:
        mode = self.convert(choice(*INIT_MODES, what="init mode"), init.mode) or "auto"
        return ir.Init(mode, init.method.text if init.method else None, init.span)

    def sync(self, sync: s.SyncStmt) -> ir.Sync:
        return ir.Sync(self.mesh_ref(sync.mesh, what="sync"), sync.span)

    def pipeline(self, block: s.PipelineStmt) -> ir.Pipeline | None:
        mesh = self.mesh_ref(block.mesh, (1,), SL216, "pipeline")
        options = dict(self.options([i for i in block.items if isinstance(i, s.Option)], PIPELINE_OPTIONS, "pipeline"))
        splits = [i for i in block.items if isinstance(i, (s.SplitBefore, s.SplitInto))]
        for extra in splits[1:]:
            self.twice("the pipeline", extra.span, splits[0].span, "split")
        if not splits:
            self.error(
                SL102,
                "the pipeline does not say where to split the model",
                block.span,
                "write `split before layers.4, layers.8` or `split layers.* into 4`",
            )
            return None
        split = splits[0]
        schedule = options.get("schedule", "1f1b")
        per_rank = options.get("stages_per_rank")
        _, fixed = ir.SCHEDULES[schedule]
        if per_rank is None:
            per_rank = fixed or 2
        elif fixed is not None and per_rank != fixed:
            self.error(
                SL215,
                f"schedule {schedule} runs {fixed} stage{'s' if fixed > 1 else ''} per rank, not {per_rank}",
                block.span,
                "interleaved_1f1b and zero_bubble run 2 or more stages per rank; zbv and dualpipe_v exactly 2",
            )
        elif fixed is None and per_rank < 2:
            self.error(
                SL215,
                f"schedule {schedule} interleaves 2 or more stages per rank, not {per_rank}",
                block.span,
                "use gpipe or 1f1b for one stage per rank",
            )
        if isinstance(split, s.SplitBefore):
            before, stack, count = tuple(self.target(t) for t in split.targets), None, None
        else:
            before, stack = (), self.target(split.target)
            # `into auto`: one stage per pp rank and virtual stage (None until the world is known)
            count = None if bare_word(split.count) == "auto" else self.convert(integer(minimum=1), split.count) or 1
        if len(mesh.dims) != 1:
            return None  # (reported above)
        return ir.Pipeline(
            mesh, before, stack, count, schedule, options.get("microbatches"), per_rank, block.span, split.span
        )

    def check_pipeline_dim(self, pipeline: ir.Pipeline, parallelize, units, syncs, loss, checks, inits) -> None:
        """The pp dim belongs to the pipeline: no other statement shards or syncs over it."""
        (dim,) = pipeline.mesh.dims or ("",)
        refs = [b.mesh for b in parallelize] + [u.mesh for u in units] + [x.mesh for x in syncs]
        for ref in refs:
            if ref.mesh == pipeline.mesh.mesh and dim in ref.dims:
                self.error(
                    SL216,
                    f"{ref} includes the pipeline dim '{dim}'",
                    ref.span,
                    f"each stage is sharded over the other dims; the pipeline at line {pipeline.span.line} owns '{dim}'",
                )
        if loss:
            self.error(
                SL216,
                "loss_parallel is not supported with a pipeline",
                loss[0].span,
                "the last stage computes the loss on its local logits; use colwise(output=replicate) for the output layer",
            )
        if inits and inits[0].mode == "rank0":
            self.error(
                SL216,
                "init rank0 is not supported with a pipeline",
                inits[0].span,
                "each stage holds other tensors than rank 0's: use init meta (or cpu, auto)",
            )
        gradients = next((c for c in checks if c.name == "gradients"), None)
        batch = gradients.get("batch") if gradients is not None else None
        if batch is not None and pipeline.microbatches is not None and batch < pipeline.microbatches:
            self.error(
                SL215,
                f"gradients(batch={batch}) cannot be split into {pipeline.microbatches} microbatches",
                gradients.span,
                f"give a batch of at least {pipeline.microbatches}",
            )

    def verify(self, verify: s.VerifyStmt) -> list[ir.Check]:
        checks = []
        for call in verify.checks:
            name = call.name.text
            if name not in CHECKS:
                hint = did_you_mean(name, CHECKS) or (f"checks: {', '.join(CHECKS)}",)
                self.error(SL101, f"unknown check '{name}'", call.name.span, *hint)
                continue
            schema = CHECKS[name]
            if name == "comms":
                args = self.kwargs(call.args, None, "check", name)
                for arg, (key, value) in zip(call.args, args):
                    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                        self.error(SL102, f"comms counts are non-negative integers, got {key}={value}", arg.span)
            else:
                args = self.kwargs(call.args, schema, "check", name)
            checks.append(ir.Check(name, args, call.span))
        return checks

    def unique_checks(self, checks: list[ir.Check]) -> None:
        first: dict[str, ir.Check] = {}
        for check in checks:
            if check.name in first:
                self.twice(f"check '{check.name}'", check.span, first[check.name].span, "listed")
            first.setdefault(check.name, check)


def _merge(base: tuple, own: tuple) -> tuple:
    """Block options overridden by a unit's own, in the block's order then the unit's new ones."""
    return tuple({**dict(base), **dict(own)}.items())
