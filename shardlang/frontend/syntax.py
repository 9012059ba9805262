"""The syntax tree: frozen nodes that mirror the plan text, each with the span it came from.

Values here are untyped (a `Name` may turn out to be a layout, a dtype or a device); static_checks.py gives
them meaning and builds the plan IR of ir.py.
"""

from __future__ import annotations

from attrs import frozen

from .source import Span

# --- values -----------------------------------------------------------------------------------


@frozen
class Name:
    text: str
    span: Span

    def __str__(self) -> str:
        return self.text


@frozen
class Int:
    value: int
    span: Span

    def __str__(self) -> str:
        return str(self.value)


@frozen
class Float:
    value: float
    span: Span

    def __str__(self) -> str:
        return repr(self.value)


@frozen
class Str:
    value: str
    span: Span

    def __str__(self) -> str:
        return f'"{self.value}"'


@frozen
class ParamRef:
    name: str
    span: Span

    def __str__(self) -> str:
        return f"${self.name}"


@frozen
class Call:
    """`name(arg, ...)`: a layout such as `shard(1)` in value position, or a style or check with keyword args."""

    name: Name
    args: tuple[Value | Arg, ...]
    span: Span

    def __str__(self) -> str:
        return f"{self.name}({', '.join(map(str, self.args))})"


@frozen
class Tuple:
    items: tuple[Value | Arg, ...]
    span: Span

    def __str__(self) -> str:
        return f"({', '.join(map(str, self.items))})"


@frozen
class Arg:
    """`name=value`, a keyword argument or a mesh dim."""

    name: Name
    value: Value
    span: Span

    def __str__(self) -> str:
        return f"{self.name}={self.value}"


Value = Name | Int | Float | Str | ParamRef | Call | Tuple

# --- targets ----------------------------------------------------------------------------------

#: One pattern segment: a name, an integer, a glob (`*`, `**`, `w*`), or an alternation of those.
Segment = str | tuple[str, ...]


@frozen
class Pattern:
    """A dotted module path with wildcards (docs/language.md §4.1). `root` is the pattern with no segments."""

    segments: tuple[Segment, ...]
    span: Span

    def __str__(self) -> str:
        if not self.segments:
            return "root"
        return ".".join(s if isinstance(s, str) else "{" + ",".join(s) + "}" for s in self.segments)


@frozen
class ClassTarget:
    """`class NAME`: modules whose class `__name__` is NAME, or whose qualified class name ends with NAME."""

    name: str
    span: Span

    def __str__(self) -> str:
        return f"class {self.name}"


Target = Pattern | ClassTarget


@frozen
class LossTarget:
    """`loss` as a `compile` target: the model file's loss function, not a module."""

    span: Span

    def __str__(self) -> str:
        return "loss"


# --- statements -------------------------------------------------------------------------------


@frozen
class MeshRef:
    """`world` (dims None), `world.tp`, `world[dp, tp]`, or `world[dp*ep]` (`flat`: the dims as one)."""

    mesh: Name
    dims: tuple[Name, ...] | None
    span: Span
    flat: bool = False

    def __str__(self) -> str:
        if self.dims is None:
            return self.mesh.text
        if self.flat:
            return f"{self.mesh}[{'*'.join(d.text for d in self.dims)}]"
        if len(self.dims) == 1:
            return f"{self.mesh}.{self.dims[0]}"
        return f"{self.mesh}[{', '.join(d.text for d in self.dims)}]"


@frozen
class VersionStmt:
    number: Int
    span: Span


@frozen
class ParamStmt:
    name: Name
    value: Value
    span: Span


@frozen
class UseStmt:
    path: str
    alias: Name
    span: Span


@frozen
class MeshStmt:
    name: Name
    device: Value
    dims: tuple[Arg, ...]
    span: Span


@frozen
class Rule:
    target: Target
    style: Call
    span: Span


@frozen
class ParallelizeStmt:
    scope: Target | None
    mesh: MeshRef
    rules: tuple[Rule, ...]
    span: Span


@frozen
class Option:
    """`name = value` (value set) or `name(arg, ...)` (args set, e.g. `mixed_precision(param=bf16)`)."""

    name: Name
    value: Value | None
    args: tuple[Arg, ...] | None
    span: Span


@frozen
class Each:
    target: Target
    options: tuple[Option, ...]
    span: Span

    @property
    def targets(self) -> tuple[Target, ...]:
        return (self.target,)


@frozen
class UnitItem:
    """`unit A, B (...)`: one unit over every module the targets match."""

    targets: tuple[Target, ...]
    options: tuple[Option, ...]
    span: Span


@frozen
class UnitsStmt:
    """A `fully_shard` or `replicate` block."""

    kind: str
    mesh: MeshRef
    items: tuple[Each | UnitItem | Option, ...]
    span: Span


@frozen
class SplitBefore:
    """`split before A, B, ...`: a stage starts at each of these blocks."""

    targets: tuple[Target, ...]
    span: Span


@frozen
class SplitInto:
    """`split STACK.* into N`: N stages of consecutive blocks of that stack, as equal as they can be."""

    target: Target
    count: Value
    span: Span


@frozen
class PipelineStmt:
    mesh: MeshRef
    items: tuple[SplitBefore | SplitInto | Option, ...]
    span: Span


@frozen
class CheckpointStmt:
    targets: tuple[Target, ...]
    span: Span


@frozen
class CompileStmt:
    """`compile TARGET, ... (option=value, ...)`: torch.compile each matched module (and the loss)."""

    targets: tuple[Target | LossTarget, ...]
    options: tuple[Option, ...]
    span: Span


@frozen
class InitStmt:
    mode: Name
    method: Name | None
    span: Span


@frozen
class SyncStmt:
    mesh: MeshRef
    span: Span


@frozen
class LossParallelStmt:
    span: Span


@frozen
class ContextParallelStmt:
    """`context_parallel on MESHREF { each TARGET; load_balance = ... }`."""

    mesh: MeshRef
    items: tuple[Each | Option, ...]
    span: Span


@frozen
class VerifyStmt:
    checks: tuple[Call, ...]
    span: Span


Statement = (
    VersionStmt
    | ParamStmt
    | UseStmt
    | MeshStmt
    | ParallelizeStmt
    | UnitsStmt
    | CheckpointStmt
    | CompileStmt
    | InitStmt
    | SyncStmt
    | LossParallelStmt
    | VerifyStmt
    | PipelineStmt
)


@frozen
class Module:
    """A whole plan file as written: its statements in order."""

    statements: tuple[Statement, ...]


def plain(value: Value) -> object:
    """A param's value as plain data (the IR keeps params so)."""
    return value.text if isinstance(value, Name) else value.value if hasattr(value, "value") else str(value)
