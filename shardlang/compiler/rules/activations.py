"""Replicated parameters where activations are sharded (SL210): the most common silent bug of sequence
parallelism.

A parameter that stays replicated over a tensor-parallel dim (a plain tensor, or a DTensor sharded over
data-parallel dims only) inside a region whose activations each TP rank holds a slice of (the sequence,
after `rowwise(output=shard(1))`) gets, on each TP rank, the gradient of its own slice only: partial,
different on every rank, and nothing all-reduces it. Training goes on, silently wrong.

The rule follows the activations' layout over each TP dim through the modules in the order they run
(compiler.trace: one forward on the meta device from the model file's example input; without one, the
order they are registered in, which the diagnostic then says): a style's output says what comes next (a
local `shard(D)` of a dim other than the last: sharded; `replicate`: replicated; a DTensor: neither;
features sharded, as a colwise leaves them inside a block: unchanged), a style that declares a sharded input (`prepare_input(input=shard(1))`,
`colwise(input=shard(1))`) says what came right before it. A module with parameters of its own that no
style of that dim places is flagged where activations are known sharded, or where it runs right before
(no rule in between) a module that declares its input sharded, and nothing before made them replicated.
Without the order they run in, the rule-less siblings of a flagged module are named with it (_with_siblings).
"""

from __future__ import annotations

from collections import defaultdict

from ...frontend import ir
from ...frontend.diagnostics import SL210, Diagnostic, few
from ..resolve import Resolution
from ..styles import DEFAULT_LAYOUTS, expand
from .common import Predictions, Shapes, dim_sizes

SHARDED, REPLICATED, OTHER, UNKNOWN = "sharded", "replicated", "other", "unknown"
#: Styles that only move activations: they place no parameter.
MOVERS = ("prepare_input", "prepare_output")
#: Styles that move activations as colwise or rowwise does (their parameters are laid out otherwise).
AS_TORCH = {"colwise_conv1d": "colwise", "rowwise_conv1d": "rowwise", "packed_colwise": "colwise"}


def _as_torch(style: ir.Style) -> ir.Style:
    """The torch style whose inputs and outputs this style's are: `colwise_gather_output` is colwise with
    `output=replicate`, `colwise_conv1d` and `packed_colwise` move activations as colwise does."""
    if style.use is not None:  # a `use` style, whatever its name (SL108): nothing is known of it
        return style
    style = expand(style)
    return ir.Style(AS_TORCH.get(style.name, style.name), style.kwargs, style.span)


def partial_gradients(
    plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes
) -> list[Diagnostic]:
    """SL210: parameters replicated over a TP dim that sit where that dim's activations are sharded."""
    sizes = dim_sizes(plan, shapes)
    found = []
    for mesh, dim in sorted({(b.mesh.mesh, d) for b in plan.parallelize for d in b.mesh.dims}):
        if sizes.get((mesh, dim), 1) <= 1:
            continue
        rules = {}
        for match in resolution.rules:
            block = plan.parallelize[match.block]
            if block.mesh.mesh == mesh and dim in block.mesh.dims:
                rules.setdefault(match.fqn, match.rule)
        placed = [fqn for fqn, rule in rules.items() if rule.style.builtin not in MOVERS]
        flagged: dict[tuple, list[str]] = {}
        state, cause, pending = UNKNOWN, None, []
        for fqn, module in _in_order(resolution):
            rule = rules.get(fqn)
            if rule is not None:
                if _declares_sharded(rule.style) and state != REPLICATED and pending:
                    flagged.setdefault(_key(rule), []).extend(pending)  # the rule that says so is the cause
                pending = []  # only the modules right before a rule feed it
                after = _after(rule.style)
                if after is not None:
                    state, cause = after, rule
                continue
            if not _has_parameters(module) or _placed(fqn, placed):
                continue
            if state == SHARDED:
                flagged.setdefault(_key(cause), []).append(fqn)
            elif state == UNKNOWN:
                pending.append(fqn)
        beside: set[str] = set()
        if not resolution.order.traced:
            flagged, beside = _with_siblings(flagged, resolution, rules, placed)
        for (span, text), modules in flagged.items():
            params = [
                f"{m}.{n}" if m else n
                for m in modules
                for n, p in resolution.modules[m]._parameters.items()
                if p is not None
            ]
            found.append(
                Diagnostic(
                    SL210,
                    f"{few(params)} {'stay' if len(params) > 1 else 'stays'} replicated over {mesh}.{dim} in a region "
                    f"whose activations are sharded over {dim} ({text}): each rank gets a partial gradient and "
                    "nothing reduces it",
                    span,
                    (
                        f"modules: {few(modules)}",
                        *_siblings_help([m for m in modules if m in beside]),
                        "give a norm `sequence_parallel`, or the module a style that places its parameters over "
                        f"{dim}; or make the activations replicated before it (`rowwise` with `output=replicate`)",
                        *_declaration_order(resolution),
                    ),
                )
            )
    return found


def _with_siblings(flagged: dict, resolution, rules: dict, placed: list[str]) -> tuple[dict, set[str]]:
    """Without the order modules run in, siblings are taken in the order they are declared, which need not
    be the one they run in (w1, w2, w3 run as w1, w3, w2): of two siblings that lost their rule alike, one
    may be read as running after `w2 : rowwise(output=shard(1))` and flagged, the other not. A reader who
    fixes the one named would miss the other, so each diagnostic also names the rule-less siblings of its
    modules (see _siblings), and a module is named once, by the first diagnostic that reaches it. Returns
    the diagnostics' modules in the order taken, and those named as siblings only."""
    order = {fqn: i for i, (fqn, _) in enumerate(_in_order(resolution))}
    children = defaultdict(list)  # parent FQN -> its children's FQNs
    for fqn in resolution.modules:
        if fqn:
            children[fqn.rpartition(".")[0]].append(fqn)
    flagged_at = {m for modules in flagged.values() for m in modules}
    named, beside, found = set(), set(), {}
    for key, modules in flagged.items():
        more = [s for m in modules for s in _siblings(m, children, resolution, rules, placed)]
        group = sorted({m for m in (*modules, *more) if m not in named}, key=lambda m: order.get(m, len(order)))
        if group:
            found[key] = group
            named.update(group)
            beside.update(m for m in more if m not in flagged_at)
    return found, beside


def _siblings(fqn: str, children: dict, resolution, rules: dict, placed: list[str]) -> list[str]:
    """The modules beside `fqn` (same parent, same class, parameters of their own) that no rule of this dim
    reaches, where some sibling is placed by one: a block in a TP chain (`feed_forward` with w2 rowwise)
    whose like modules lost their rule together (a typo in `feed_forward.{w1,w3}`)."""
    if not fqn:
        return []
    beside = [c for c in children[fqn.rpartition(".")[0]] if c != fqn]
    if not any(c in placed for c in beside):
        return []
    kind = type(resolution.modules[fqn])
    return [
        c
        for c in beside
        if type(resolution.modules[c]) is kind
        and c not in rules
        and _has_parameters(resolution.modules[c])
        and not _placed(c, placed)
    ]


def _siblings_help(beside: list[str]) -> tuple[str, ...]:
    if not beside:
        return ()
    return (
        f"{few(beside)} {'sit' if len(beside) > 1 else 'sits'} beside them with no rule either: which of them "
        "run where activations are sharded is not known without the order modules run in",
    )


def _has_parameters(module) -> bool:
    return any(p is not None for p in module._parameters.values())


def _in_order(resolution) -> list[tuple[str, object]]:
    """(FQN, module) in the order the modules run when the model was traced (modules that never ran have no
    gradient and are left out), else in the order they are registered."""
    order = resolution.order.modules
    if order is None:
        return list(resolution.modules.items())
    return [(fqn, resolution.modules[fqn]) for fqn in order if fqn in resolution.modules]


def _declaration_order(resolution) -> tuple[str, ...]:
    """A help line saying the modules were taken in the order they are declared, which need not be the
    order they run in, and why; nothing when the model was traced."""
    if resolution.order.traced:
        return ()
    return (
        f"modules were taken in the order they are declared, not run ({resolution.order.why}): a model "
        "that declares a module before one it runs after (`feed_forward` before `ffn_norm`) can be misread",
    )


def _key(rule: ir.Rule) -> tuple:
    return rule.span, f"`{rule.target} : {rule.style.name}` at line {rule.span.line}"


def _placed(fqn: str, placed: list[str]) -> bool:
    return any(fqn == p or fqn.startswith(p + ".") or not p for p in placed)


def _sharded(layout) -> bool:
    """A layout that shards a dim other than the last (the sequence, not the features)."""
    if isinstance(layout, tuple):
        return any(_sharded(item) for item in layout)
    return isinstance(layout, ir.Shard) and layout.dim != -1


def _declares_sharded(style: ir.Style) -> bool:
    """The style says in words that its input arrives sharded (`input=shard(1)`); sequence_parallel only
    assumes it."""
    style = _as_torch(style)
    return style.builtin in ("colwise", "rowwise", "prepare_input") and _sharded(style.get("input"))


def _first(layout):
    return layout[0] if isinstance(layout, tuple) and layout else layout


def _after(style: ir.Style) -> str | None:
    """The layout of activations after a module with this style: SHARDED, REPLICATED, OTHER, or None
    (unchanged: its children's styles decide)."""
    style = _as_torch(style)
    name = style.builtin
    if name in ("replicated_with_grad_allreduce", "mla_kv_a_proj"):  # activations unchanged
        return None
    if name in ("expert_parallel", "expert_tensor_parallel"):  # tokens whole on every rank
        return REPLICATED
    if name in ("colwise", "rowwise"):
        output, local = style.get("output", DEFAULT_LAYOUTS[name].output), style.get("local_output", True)
        if isinstance(output, ir.Replicate):
            return REPLICATED
        if isinstance(output, ir.Shard) and output.dim == -1 and local:
            # Features sharded: inside a block, between a colwise and the rowwise that ends it. Modules
            # are registered in an order (w1, w2, w3) that need not be the order they run (w1, w3, w2),
            # so this says nothing of what comes after the block.
            return None
        return SHARDED if local and _sharded(output) else OTHER
    if name == "sequence_parallel":
        return SHARDED if style.get("local_output", False) else OTHER
    if name == "prepare_input":
        desired = _first(style.get("desired"))
        return REPLICATED if isinstance(desired, ir.Replicate) else OTHER if desired is not None else None
    if name == "prepare_output":
        desired = _first(style.get("desired"))
        if isinstance(desired, ir.Replicate):
            return REPLICATED
        return SHARDED if style.get("local_output", True) and _sharded(desired) else OTHER
    return OTHER
