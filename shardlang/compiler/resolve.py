"""Patterns and targets -> module FQNs on a model (the meta device is enough): the plan resolved.

Pattern semantics (docs/language.md §4.1): `*` is exactly one segment, `**` zero or more, globs and alternations
match inside one segment, `root` is the model itself, `class NAME` matches by class. The matching
is patterns.pattern_regex and class_matches, which the printed program uses too. Rules of a
`parallelize SCOPE` block are matched relative to each module the scope matches.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache

import torch.nn as nn
from attrs import field, frozen

from ..frontend import ir, patterns
from ..frontend.diagnostics import SL200, SL201, Diagnostic, did_you_mean, few
from ..frontend.syntax import ClassTarget, Pattern, Target
from .stages import Stages, split
from .trace import Order


@frozen
class RuleMatch:
    """One module a parallelize rule applies to."""

    block: int  # index into plan.parallelize
    scope: str  # FQN of the scope module ("" for the root)
    fqn: str  # FQN of the matched module
    rule: ir.Rule

    @property
    def relative(self) -> str:
        return self.fqn[len(self.scope) + 1 :] if self.scope else self.fqn


@frozen
class UnitMatch:
    """One fully_shard or replicate unit: the module it wraps and its `each` or `unit` item (None for the
    implicit root). A `unit` over several modules wraps `fqn`, the first in model order, and `also`."""

    block: int  # index into plan.units
    fqn: str
    unit: ir.Unit | None
    also: tuple[str, ...] = ()

    @property
    def fqns(self) -> tuple[str, ...]:
        """Every module the unit wraps."""
        return (self.fqn, *self.also)

    @property
    def name(self) -> str:
        """The modules it wraps, for people: `root`, `layers.0`, `norm, output`."""
        return ", ".join(f or "root" for f in self.fqns)

    def options(self, units: ir.Units) -> tuple[tuple[str, object], ...]:
        """The unit's effective options (the implicit root unit has the block's)."""
        return self.unit.options if self.unit is not None else units.options

    def option(self, units: ir.Units, name: str, default=None):
        return dict(self.options(units)).get(name, default)

    def kind(self, units: ir.Units) -> str:
        """`fully_shard` or `replicate`; FSDP1's `strategy = no_shard` is plain replication."""
        return (
            "replicate" if units.kind == "replicate" or self.option(units, "strategy") == "no_shard" else "fully_shard"
        )


@frozen
class Resolution:
    """What every statement of a plan applies to on one model. Module FQNs are those of `named_modules()`."""

    modules: dict[str, nn.Module] = field(eq=False, repr=False)
    rules: tuple[RuleMatch, ...]
    units: tuple[UnitMatch, ...]  # children first, root last
    checkpoint: tuple[str, ...]
    stages: Stages | None = None  # the pipeline's split, when the plan has one
    #: The order the model's modules run in, when lint was given an example input to trace it (compiler.trace).
    order: Order = Order(None, "no example input was given")
    #: The modules `compile` statements match, each with its statement, in model order.
    compiled: tuple[tuple[str, ir.Compile], ...] = ()
    #: The modules context_parallel runs attention in, in model order.
    context: tuple[str, ...] = ()


def resolve(
    plan: ir.Plan, model: nn.Module, pp: int = 1, order: Order | None = None
) -> tuple[Resolution, list[Diagnostic]]:
    """Match every target of `plan` against `model`. SL200 for a pattern that matches nothing. `pp` is the
    size of a pipeline's dim (for `split STACK into auto`); `order`, the order the model's modules run in
    (compiler.trace), places a pipeline's modules outside its stack."""
    modules = tuple(model.named_modules())
    found: list[Diagnostic] = []
    rules = []
    for b, block in enumerate(plan.parallelize):
        scopes = _matches(block.scope, modules, "") if block.scope is not None else [""]
        if block.scope is not None and not scopes:
            found.append(_no_match(block.scope, modules, ""))
            continue
        by_fqn = dict(modules)
        for rule in block.rules:
            matched = False
            for scope in scopes:
                for fqn in _matches(rule.target, _subtree(by_fqn[scope], scope), scope):
                    rules.append(RuleMatch(b, scope, fqn, rule))
                    matched = True
            if not matched:
                found.append(_no_match(rule.target, _subtree(by_fqn[scopes[0]], scopes[0]), scopes[0], len(scopes)))

    units = []
    for b, block in enumerate(plan.units):
        for unit in block.units:
            if unit.together:
                match, problems = _together(unit, modules)
                found += problems
                units += [UnitMatch(b, match[0], unit, tuple(match[1:]))] if match else []
                continue
            fqns = _matches(unit.target, modules, "")
            if not fqns:
                found.append(_no_match(unit.target, modules, ""))
            units += [UnitMatch(b, fqn, unit) for fqn in fqns]
        if block.root and not any(u.fqn == "" and u.block == b for u in units):
            units.append(UnitMatch(b, "", None))

    units = _named_units_win(plan, units)

    checkpoint = []
    for target in plan.checkpoint:
        fqns = _matches(target, modules, "")
        if not fqns:
            found.append(_no_match(target, modules, ""))
        checkpoint += [f for f in fqns if f not in checkpoint]

    compiled, problems = _compiled(plan, modules)
    found += problems
    context = []
    for target in plan.context_parallel.targets if plan.context_parallel is not None else ():
        fqns = _matches(target, modules, "")
        if not fqns:
            found.append(_no_match(target, modules, ""))
        context += [f for f in fqns if f not in context]

    stages = None
    if plan.pipeline is not None:
        stages, problems = split(plan.pipeline, model, lambda target: _matches(target, modules, ""), pp, order)
        found += problems

    order = {fqn: i for i, (fqn, _) in enumerate(modules)}
    # Children first: a unit after every unit inside any of its modules (its shallowest module's depth)
    units.sort(key=lambda u: (-min(map(patterns.depth, u.fqns)), order.get(u.fqn, 0)))
    resolution = Resolution(
        dict(modules), tuple(rules), tuple(units), tuple(checkpoint), stages, compiled=compiled, context=tuple(context)
    )
    return resolution, found


def _compiled(plan: ir.Plan, modules) -> tuple[tuple[tuple[str, ir.Compile], ...], list[Diagnostic]]:
    """The modules each `compile` target matches (SL200 for none). A module compiled twice, or inside a
    module already compiled (whose compiled forward traces through it), is SL201: say which to compile."""
    found, by_fqn = [], {}
    for c in plan.compiles:
        fqns = _matches(c.target, modules, "")
        if not fqns:
            found.append(_no_match(c.target, modules, ""))
        for fqn in fqns:
            outer = next((o for o in by_fqn if patterns.within(fqn, o) or patterns.within(o, fqn)), None)
            if outer is None:
                by_fqn[fqn] = c
                continue
            first = by_fqn[outer]
            if outer == fqn:
                message = f"module '{fqn or 'root'}' is compiled twice (first at line {first.span.line})"
            else:
                where = "inside" if patterns.within(outer, fqn) else "around"
                message = (
                    f"module '{fqn or 'root'}' is compiled, and so is '{outer or 'root'}' {where} it "
                    f"(line {first.span.line})"
                )
            found.append(
                Diagnostic(
                    SL201,
                    message,
                    c.target.span,
                    help=("compile each module once: a compiled module's forward compiles what it calls",),
                )
            )
    order = {fqn: i for i, (fqn, _) in enumerate(modules)}
    return tuple(sorted(by_fqn.items(), key=lambda item: order[item[0]])), found


def _together(unit: ir.Unit, modules) -> tuple[list[str], list[Diagnostic]]:
    """The modules of a `unit` item in model order: every match of its targets (SL200 for a target that
    matches none). One inside another is SL201: the outer one's unit would hold the inner one's
    parameters already."""
    found, fqns = [], set()
    for target in unit.targets:
        matched = _matches(target, modules, "")
        if not matched:
            found.append(_no_match(target, modules, ""))
        fqns.update(matched)
    ordered = [fqn for fqn, _ in modules if fqn in fqns]
    for fqn in ordered:
        outer = next((o for o in ordered if o != fqn and patterns.within(fqn, o)), None)
        if outer is not None:
            found.append(
                Diagnostic(
                    SL201,
                    f"`{unit}` lists '{fqn}' and '{outer or 'root'}', which holds it",
                    unit.span,
                    help=(
                        f"list '{outer or 'root'}' alone: a unit manages the parameters of everything inside its modules",
                    ),
                )
            )
            return [], found
    return ordered, found


def _named_units_win(plan: ir.Plan, units: list[UnitMatch]) -> list[UnitMatch]:
    """A `class` target does not pick a module that a unit of the other kind names by pattern
    (patterns.named_units_win, which the printed program applies too)."""
    matches = [
        (u.fqn, u.kind(plan.units[u.block]), u.unit is not None and isinstance(u.unit.target, ClassTarget), u)
        for u in units
    ]
    return [u for *_, u in patterns.named_units_win(matches)]


def _subtree(module: nn.Module, prefix: str) -> tuple[tuple[str, nn.Module], ...]:
    return tuple(module.named_modules(prefix=prefix))


def _relative(fqn: str, scope: str) -> str:
    if not scope:
        return fqn
    return "" if fqn == scope else fqn[len(scope) + 1 :]


_regex = cache(patterns.pattern_regex)


def _matches(target: Target, modules: tuple[tuple[str, nn.Module], ...], scope: str) -> list[str]:
    """FQNs of the modules under `scope` (those in `modules`) that `target` matches, in module order.
    The same matching as patterns.modules_matching, which the printed program uses."""
    if isinstance(target, ClassTarget):
        return [fqn for fqn, m in modules if patterns.class_matches(target.name, type(m))]
    regex = _regex(str(target))
    return [fqn for fqn, _ in modules if regex.fullmatch(_dotted(_relative(fqn, scope)))]


def _dotted(relative: str) -> str:
    return "." + relative if relative else ""


def _no_match(target: Target, modules: tuple[tuple[str, nn.Module], ...], scope: str, scopes: int = 1) -> Diagnostic:
    where = (
        f" under {scope or 'the model'}" + (f" (the first of {scopes} scopes)" if scopes > 1 else "") if scope else ""
    )
    if isinstance(target, ClassTarget):
        names = sorted({type(m).__name__ for _, m in modules})
        hint = did_you_mean(target.name.split(".")[-1], names) or (f"module classes here: {few(names)}",)
        return Diagnostic(SL200, f"no module of class '{target.name}'{where}", target.span, hint)
    return Diagnostic(
        SL200, f"pattern '{target}' matches no module{where}", target.span, _closest(target, modules, scope)
    )


def _closest(pattern: Pattern, modules: tuple[tuple[str, nn.Module], ...], scope: str) -> tuple[str, ...]:
    """Help for a pattern that matches nothing: where matching stops, and the names that exist there."""
    relative = [_relative(fqn, scope) for fqn, _ in modules]
    for k in range(1, len(pattern.segments) + 1):
        regex = _regex(str(Pattern(pattern.segments[:k], pattern.span)))
        if any(regex.fullmatch(_dotted(r)) for r in relative):
            continue
        parents_regex = _regex(str(Pattern(pattern.segments[: k - 1], pattern.span)))
        parents = [r for r in relative if parents_regex.fullmatch(_dotted(r))]
        children = sorted({c for p in parents for c in _children(p, relative)}, key=_natural)
        segment = pattern.segments[k - 1]
        text = segment if isinstance(segment, str) else "{" + ",".join(segment) + "}"
        at = ".".join(str(s) if isinstance(s, str) else "{" + ",".join(s) + "}" for s in pattern.segments[: k - 1])
        parent = _parent(scope, at)
        place = f"under {parent}" if parent else "at the top"
        words = [text] if isinstance(segment, str) else list(segment)
        hints = [h for w in words for h in did_you_mean(w, children)]
        if hints:
            return (f"there is no '{text}' {place}; {hints[0]}", *_lost(pattern, k - 1, children, relative))
        if children:
            return (f"there is no '{text}' {place}; it has {few(children)}",)
        return (f"{parent or 'the model'} has no submodules",)
    return ()


def _parent(scope: str, at: str) -> str:
    """The module a name was looked for under, as the help says it ("" for the model's root). A block's
    rule is relative to its scope, so it is said under the scope module it was matched in (`layers.0.attention`):
    `at the top` would send the reader to the model's root, where nobody wrote the name."""
    if scope:
        return f"{scope}.{at}" if at else scope
    return f"'{at}'" if at else ""


def _lost(pattern: Pattern, index: int, children: list[str], relative: list[str]) -> tuple[str, ...]:
    """The modules a misspelt pattern was meant for (each misspelt word of segment `index` read as its
    nearest name): every one of them lost its rule, not only those a later diagnostic happens to name."""
    segment = pattern.segments[index]
    words = [segment] if isinstance(segment, str) else list(segment)
    meant = []
    for word in words:
        if any(_regex(word).fullmatch(c) for c in children):
            meant.append(word)
            continue
        hint = did_you_mean(word, children)
        nearest = re.search(r"'([^']+)'", hint[0]) if hint else None
        if nearest is None:
            return ()
        meant.append(nearest.group(1))
    fixed = meant[0] if isinstance(segment, str) else tuple(dict.fromkeys(meant))
    segments = (*pattern.segments[:index], fixed, *pattern.segments[index + 1 :])
    regex = _regex(str(Pattern(segments, pattern.span)))
    matched = [r for r in relative if regex.fullmatch(_dotted(r))]
    if not matched:
        return ()
    return (f"so the rule reaches none of the modules it was meant for: {few(matched)}",)


def _children(parent: str, relative: list[str]) -> Iterator[str]:
    depth = patterns.depth(parent)
    prefix = parent + "." if parent else ""
    for r in relative:
        if r.startswith(prefix) and patterns.depth(r) == depth + 1:
            yield r[len(prefix) :]


def _natural(name: str):
    return (0, int(name), "") if name.isdigit() else (1, 0, name)
