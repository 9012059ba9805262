"""The plan IR: what a checked plan means, in typed frozen nodes that keep their spans. Data only.

static_checks.py builds it from the syntax tree; the compiler, the runtime and the checks read it.
Nothing here imports a later stage: the library's verbs (`plan.lint`, `plan.apply`, ...) are on the
facade in shardlang.api, a subclass of this `Plan`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

import attrs
from attrs import field, frozen

from .diagnostics import Diagnostic
from .source import Source, Span
from .syntax import ClassTarget, Pattern, Target

__all__ = ["ClassTarget", "Pattern", "Target"]

# --- layouts (docs/language.md §4.2) ------------------------------------------------------------------------


@frozen
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"shard({self.dim})"


@frozen
class Replicate:
    def __str__(self) -> str:
        return "replicate"


@frozen
class Partial:
    def __str__(self) -> str:
        return "partial"


@frozen
class StridedShard:
    """FSDP's shard of a tensor already sharded on the same dim by a later mesh dim (torch's `_StridedShard`)."""

    dim: int
    split_factor: int

    def __str__(self) -> str:
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"


@frozen
class NonTensor:
    """`_`: a positional input that is not a tensor and is passed through untouched."""

    def __str__(self) -> str:
        return "_"


@frozen
class Local:
    """`distribute(output=local)`: the module's output DTensor becomes a plain local tensor."""

    def __str__(self) -> str:
        return "local"


Layout = Shard | Replicate | Partial


@frozen
class DType:
    """A torch dtype by its torch name (`bfloat16`, `float16`, `float32`)."""

    name: str

    def __str__(self) -> str:
        return self.name


@frozen
class MixedPrecision:
    """`mixed_precision(param=, reduce=, output=, cast_forward_inputs=)` -> MixedPrecisionPolicy."""

    param: DType | None = None
    reduce: DType | None = None
    output: DType | None = None
    cast_forward_inputs: bool = True


# --- meshes -------------------------------------------------------------------------------------


def fixed_size(sizes: Iterable[int | None]) -> int:
    """The product of a mesh's dim sizes, an `auto` dim (None) left out: the one place mesh sizes multiply."""
    return math.prod(n for n in sizes if n is not None)


@frozen
class MeshDim:
    name: str
    size: int | None  # None: `auto`, filled from the world size
    span: Span


@frozen
class Mesh:
    name: str
    device: str  # "cuda" | "cpu" | "auto"
    dims: tuple[MeshDim, ...]
    span: Span

    @property
    def dim_names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    @property
    def fixed_size(self) -> int:
        """The ranks its sized dims span (all of the mesh when no dim is `auto`)."""
        return fixed_size(d.size for d in self.dims)

    def shape(self, world_size: int) -> tuple[int, ...]:
        """The mesh shape with its `auto` dim filled in (check_world has made sure it fits)."""
        return tuple(d.size if d.size is not None else world_size // self.fixed_size for d in self.dims)


@frozen
class MeshRef:
    """Some dims of a mesh, in the order the plan names them (all of them for a bare `world`)."""

    mesh: str
    dims: tuple[str, ...]
    span: Span
    #: `world[dp*ep]`: the dims flattened into one (DeviceMesh._flatten), named `flat_name`.
    flat: bool = False

    def __str__(self) -> str:
        if self.flat:
            return f"{self.mesh}[{'*'.join(self.dims)}]"
        return f"{self.mesh}.{self.dims[0]}" if len(self.dims) == 1 else f"{self.mesh}[{', '.join(self.dims)}]"

    @property
    def flat_name(self) -> str:
        """The flattened dim's name, as its DeviceMesh calls it: the dims joined by `_`."""
        return "_".join(self.dims)

    @property
    def ndim(self) -> int:
        """How many dims the mesh this names has: one when flattened."""
        return 1 if self.flat else len(self.dims)


# --- statements ---------------------------------------------------------------------------------


@frozen
class Use:
    path: str
    alias: str
    span: Span


@frozen
class Style:
    """A tensor-parallel style with its typed keyword arguments; `use` is set for user styles."""

    name: str
    kwargs: tuple[tuple[str, Any], ...]
    span: Span
    use: Use | None = None

    def get(self, name: str, default: Any = None) -> Any:
        return next((v for k, v in self.kwargs if k == name), default)

    @property
    def builtin(self) -> str | None:
        """The built-in style this is, by name; None for a `use` style, whose alias may be a built-in's
        name (SL108): code that acts on what a built-in does asks this, never `name`."""
        return None if self.use is not None else self.name


@frozen
class Rule:
    target: Target
    style: Style
    span: Span


@frozen
class Parallelize:
    scope: Target | None
    mesh: MeshRef
    rules: tuple[Rule, ...]
    span: Span


@frozen
class Unit:
    """One `each TARGET` of a fully_shard or replicate block (a unit per module it matches), or one `unit
    TARGET, ...` (`together`: one unit over every module its targets match, `more` being the targets after
    the first), with its effective options (block's, then its own)."""

    target: Target
    options: tuple[tuple[str, Any], ...]
    span: Span
    more: tuple[Target, ...] = ()
    together: bool = False

    @property
    def targets(self) -> tuple[Target, ...]:
        return (self.target, *self.more)

    def __str__(self) -> str:
        return f"unit {', '.join(map(str, self.targets))}" if self.together else f"each {self.target}"

    def get(self, name: str, default: Any = None) -> Any:
        return next((v for k, v in self.options if k == name), default)


@frozen
class Units:
    """A `fully_shard` or `replicate` block. `root` unit is added last unless the block says `root = false`."""

    kind: str  # "fully_shard" | "replicate"
    mesh: MeshRef
    units: tuple[Unit, ...]
    options: tuple[tuple[str, Any], ...]
    root: bool
    span: Span
    #: The mesh whose size divides the units' gradients instead of their own mesh's (FSDP2's
    #: set_gradient_divide_factor): set on the experts' units that desugar.expert_units adds.
    divide_by: MeshRef | None = None


@frozen
class Compile:
    """One target of a `compile` statement, with torch.compile's options (fullgraph, dynamic, mode, backend)."""

    target: Target
    options: tuple[tuple[str, Any], ...]
    span: Span


@frozen
class CompileLoss:
    """`compile loss`: the model file's loss function is compiled (`torch.compile(loss, **options)`)
    wherever shardlang calls it on the sharded model; `Plan.loss` hands it to a training loop."""

    options: tuple[tuple[str, Any], ...]
    span: Span


@frozen
class ContextParallel:
    """`context_parallel on world.cp { each TARGET }`: every input's sequence split over the dim as its
    load balancer says, the matched modules' scaled_dot_product_attention run over the whole sequence
    (runtime.context), the output gathered back whole."""

    mesh: MeshRef
    targets: tuple[Target, ...]
    #: `load_balance = NAME` (schema.LOAD_BALANCERS): how the sequence is laid out over the ranks
    #: (runtime.context_layout.LAYOUTS), `headtail` by default.
    load_balance: str
    span: Span
    #: `output = whole` (default): the model's outputs gathered back whole; `local`: each rank's shard.
    whole_output: bool = True


@frozen
class Init:
    mode: str  # "meta" | "rank0" | "cpu" | "auto"
    #: `init meta with METHOD`; None: the model's own way (compiler.initialisers)
    method: str | None = None
    span: Span | None = None

    def __str__(self) -> str:
        return f"init {self.mode}" + (f" with {self.method}" if self.method else "")


@frozen
class Sync:
    mesh: MeshRef
    span: Span


@frozen
class Check:
    """A verification check (docs/checks.md) with its typed arguments."""

    name: str
    args: tuple[tuple[str, Any], ...]
    span: Span | None = None

    def get(self, name: str, default: Any = None) -> Any:
        return next((v for k, v in self.args if k == name), default)


#: Pipeline schedules (docs/language.md §4.5): the torch class, and how many stages each rank holds
#: (None: two or more). Stage s sits on pp rank s % pp, except for the V schedules (`zbv`,
#: `dualpipe_v`), where rank r holds stages r and 2 pp - 1 - r.
SCHEDULES: dict[str, tuple[str, int | None]] = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", None),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", None),
    "zbv": ("ScheduleZBVZeroBubble", 2),
    "dualpipe_v": ("ScheduleDualPipeV", 2),
}
V_SCHEDULES = ("zbv", "dualpipe_v")


@frozen
class Pipeline:
    """`pipeline on MESH.DIM { split ...; schedule = ...; microbatches = N; stages_per_rank = N }`.

    The split is either `split before A, B, ...` (`before`: the blocks that start stages 1, 2, ...) or
    `split STACK.* into N` (`stack`, `count`; None for `into auto`: pp x stages_per_rank stages)."""

    mesh: MeshRef
    before: tuple[Target, ...]
    stack: Target | None
    count: int | None
    schedule: str
    microbatches: int | None  # None: pp size x stages_per_rank
    stages_per_rank: int
    span: Span
    split_span: Span | None = None

    def stage_ranks(self, pp: int) -> tuple[int, ...]:
        """The pp rank of each stage."""
        n = pp * self.stages_per_rank
        if self.schedule in V_SCHEDULES:
            return tuple(s if s < pp else n - 1 - s for s in range(n))
        return tuple(s % pp for s in range(n))

    def n_microbatches(self, pp: int) -> int:
        return self.microbatches if self.microbatches is not None else pp * self.stages_per_rank


@frozen
class Plan:
    """A checked plan. Immutable: stages read it and return new values."""

    source: Source
    params: tuple[tuple[str, Any], ...] = ()
    uses: tuple[Use, ...] = ()
    meshes: tuple[Mesh, ...] = ()
    parallelize: tuple[Parallelize, ...] = ()
    checkpoint: tuple[Target, ...] = ()
    compiles: tuple[Compile, ...] = ()
    units: tuple[Units, ...] = ()
    init: Init = Init("auto")
    syncs: tuple[Sync, ...] = ()
    loss_parallel: Span | None = None
    compile_loss: CompileLoss | None = None
    context_parallel: ContextParallel | None = None
    pipeline: Pipeline | None = None
    checks: tuple[Check, ...] = ()
    #: Warnings found while checking (errors raise PlanError instead).
    diagnostics: tuple[Diagnostic, ...] = field(default=(), eq=False)

    def mesh(self, name: str) -> Mesh:
        return next(m for m in self.meshes if m.name == name)

    def param(self, name: str) -> Any:
        return dict(self.params)[name]

    def has_style(self, name: str) -> bool:
        """Whether any `parallelize` rule uses the style `name`."""
        return any(r.style.builtin == name for b in self.parallelize for r in b.rules)

    def fixed_world_size(self) -> int:
        """The world the meshes fix when none of their dims is `auto`; ValueError otherwise."""
        sizes = set()
        for mesh in self.meshes:
            if any(d.size is None for d in mesh.dims):
                raise ValueError(f"mesh '{mesh.name}' has an auto dim: give the world size")
            sizes.add(mesh.fixed_size)
        if len(sizes) != 1:
            raise ValueError("give the world size")
        return sizes.pop()


def to_data(value: Any) -> Any:
    """A JSON-ready view of any IR value, for golden files and `--format json` dumps. Spans become `l:c-l:c`."""
    if isinstance(value, Span):
        return value.short()
    if isinstance(value, (Source, Diagnostic)):
        return None
    if attrs.has(type(value)):
        data = {"node": type(value).__name__}
        for f in attrs.fields(type(value)):
            item = to_data(getattr(value, f.name))
            if item is not None and item != () and item != []:
                data[f.name] = item
        return data
    if isinstance(value, (tuple, list)):
        return [to_data(v) for v in value]
    return value


def dump(value: Any, width: int = 100) -> str:
    """`to_data` as JSON, one line per node where it fits in `width`: the golden-file form of the IR."""
    return _dump(to_data(value), 0, width) + "\n"


def _dump(data: Any, indent: int, width: int) -> str:
    flat = json.dumps(data, ensure_ascii=False)
    if len(flat) + indent <= width or not isinstance(data, (dict, list)) or not data:
        return flat
    pad = " " * (indent + 2)
    if isinstance(data, dict):
        items = [f"{pad}{json.dumps(k)}: {_dump(v, indent + 2, width)}" for k, v in data.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + _dump(v, indent + 2, width) for v in data]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
