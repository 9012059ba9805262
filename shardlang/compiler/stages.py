"""A `pipeline` statement resolved on a module tree: which blocks of the model's stack each stage holds,
and which modules outside the stack go with the first or the last stage (docs/language.md §4.5).

The model contract: the model's forward runs the blocks of one stack (a ModuleList, ModuleDict or
Sequential) in order, each taking the running activation as its first argument and returning it. Every
module with parameters outside the stack runs before the stack (it belongs to the first stage) or after
it (the last stage), as the order the modules run in says (traced: compiler.trace), or, where it is not
known, the order the model declares them in; modules without parameters (rotary tables, masks) run on
every stage. Data only: the runtime cuts the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn
from attrs import frozen

from ..frontend import ir
from ..frontend.diagnostics import SL200, SL211, SL212, SL214, Diagnostic, few
from .trace import Order

STACKS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@frozen
class Stages:
    """The model cut into stages: the stack's FQN, each stage's blocks (FQNs, in order), and the modules
    with parameters outside the stack that the first and the last stage hold."""

    stack: str
    blocks: tuple[tuple[str, ...], ...]
    first: tuple[str, ...]
    last: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.blocks)

    def stage_of(self, fqn: str) -> int | None:
        """The stage that holds module `fqn`; None for a module every stage keeps (the root, the stack,
        their parameterless children)."""
        for s, blocks in enumerate(self.blocks):
            if any(_within(fqn, b) for b in blocks):
                return s
        if any(_within(fqn, m) for m in self.first):
            return 0
        if any(_within(fqn, m) for m in self.last):
            return self.count - 1
        return None

    def held(self, stage: int) -> tuple[str, ...]:
        """The modules (blocks and outside modules) that stage keeps, besides the ones every stage keeps."""
        return self.blocks[stage] + (self.first if stage == 0 else ()) + (self.last if stage == self.count - 1 else ())

    def dropped(self, stage: int) -> tuple[tuple[str, str], ...]:
        """(FQN, role) of every module that stage replaces by a pass-through: `block` (a block of another
        stage), `before` (an outside module that runs before the stack) or `after`."""
        out = [(b, "block") for s, blocks in enumerate(self.blocks) if s != stage for b in blocks]
        if stage != 0:
            out += [(m, "before") for m in self.first]
        if stage != self.count - 1:
            out += [(m, "after") for m in self.last]
        return tuple(out)


def _within(fqn: str, owner: str) -> bool:
    return fqn == owner or fqn.startswith(owner + ".")


def split(
    pipeline: ir.Pipeline, model: nn.Module, matches, pp: int, order: Order | None = None
) -> tuple[Stages | None, list[Diagnostic]]:
    """Resolve the split on `model`. `matches(target)` lists the FQNs a target matches (resolve's matcher);
    `pp` is the pipeline dim's size (`split STACK into auto` makes pp x stages_per_rank stages); `order`,
    the order the model's modules run in (compiler.trace), places the modules outside the stack."""
    modules = dict(model.named_modules())
    if pipeline.stack is not None:
        fqns = matches(pipeline.stack)
        if not fqns:
            return None, [Diagnostic(SL200, f"pattern '{pipeline.stack}' matches no module", pipeline.stack.span)]
        stack, problem = _parent(fqns, modules)
        if problem:
            return None, [
                Diagnostic(
                    SL211, f"'{pipeline.stack}' matches modules {problem}", pipeline.stack.span, _stack_help(model)
                )
            ]
        blocks = _children(stack, modules)
        if set(fqns) != set(blocks):
            missing = [b for b in blocks if b not in fqns]
            return None, [
                Diagnostic(
                    SL211,
                    f"'{pipeline.stack}' leaves out blocks of {stack}: {few(missing)}",
                    pipeline.stack.span,
                    (f"write `split {stack}.* into {pipeline.count or 'auto'}` to cut the whole stack",),
                )
            ]
        n = pipeline.count or pp * pipeline.stages_per_rank
        if n > len(blocks):
            return None, [
                Diagnostic(
                    SL212,
                    f"{n} stages of {len(blocks)} blocks: {n - len(blocks)} stage(s) would hold no block",
                    pipeline.split_span,
                    (f"split {stack} into at most {len(blocks)} stages",),
                )
            ]
        sizes = [len(blocks) // n + (s < len(blocks) % n) for s in range(n)]
        starts = [sum(sizes[:s]) for s in range(n)]
    else:
        found, points = [], []
        for target in pipeline.before:
            fqns = matches(target)
            if len(fqns) != 1:
                what = "matches no module" if not fqns else f"matches {len(fqns)} modules ({few(fqns)})"
                found.append(
                    Diagnostic(SL211, f"split point '{target}' {what}", target.span, ("name one block, e.g. layers.8",))
                )
            else:
                points.append((target, fqns[0]))
        if found:
            return None, found
        stack, problem = _parent([f for _, f in points], modules)
        if problem:
            names = ", ".join(f"'{target}'" for target, _ in points)
            what = f"split point {names} is" if len(points) == 1 else f"split points {names} are"
            return None, [Diagnostic(SL211, f"{what} {problem}", pipeline.split_span, _stack_help(model))]
        blocks = _children(stack, modules)
        starts = [0]
        for target, fqn in points:
            at = blocks.index(fqn)
            if at <= starts[-1]:
                code, message = (
                    (SL212, f"split before '{target}', the first block: stage 0 would hold no block")
                    if at == 0
                    else (SL211, f"split point '{target}' is not after the one before it")
                )
                return None, [Diagnostic(code, message, target.span, ("list the split points in block order",))]
            starts.append(at)
    ends = [*starts[1:], len(blocks)]
    stages_blocks = tuple(tuple(blocks[a:b]) for a, b in zip(starts, ends))
    first, last, found = _outside(model, stack, pipeline, _ran_before(order, blocks[0]))
    if found:
        return None, found
    stages = Stages(stack, stages_blocks, first, last)
    return stages, _shared(model, stages, pipeline)


def _parent(fqns: Sequence[str], modules: dict[str, nn.Module]) -> tuple[str, str]:
    """The one stack (ModuleList, ModuleDict, Sequential) whose children `fqns` are; else a problem, in words."""
    parents = {f.rpartition(".")[0] for f in fqns}
    if len(parents) != 1 or any(not f for f in fqns):
        return "", f"not in one stack (under {few(sorted(parents))})"
    (parent,) = parents
    if not isinstance(modules[parent], STACKS):
        kind = type(modules[parent]).__name__
        return "", f"not in a ModuleList, ModuleDict or Sequential ({parent or 'the model'} is a {kind})"
    return parent, ""


def _children(stack: str, modules: dict[str, nn.Module]) -> list[str]:
    return [f"{stack}.{name}" if stack else name for name, _ in modules[stack].named_children()]


def _stack_help(model: nn.Module) -> tuple[str, ...]:
    stacks = [f for f, m in model.named_modules() if isinstance(m, STACKS) and len(m) > 1]
    return (f"the model's stacks: {few(stacks)}",) if stacks else ("the model has no ModuleList of blocks to cut",)


def _ran_before(order: Order | None, first_block: str):
    """fqn -> whether module `fqn` first ran before the stack's first block (None where the trace does not
    say: no trace, or a module that did not run)."""
    if order is None or order.modules is None or first_block not in order.modules:
        return lambda fqn: None
    ran = {fqn: i for i, fqn in enumerate(order.modules)}
    start = ran[first_block]
    return lambda fqn: ran[fqn] < start if fqn in ran else None


def _outside(
    model: nn.Module, stack: str, pipeline: ir.Pipeline, ran_before
) -> tuple[tuple[str, ...], tuple[str, ...], list]:
    """The modules with parameters beside the path from the root to the stack: those that run before the
    stack (first stage) and those that run after it (last stage), as `ran_before(fqn)` says, or where it does
    not know, as declared: before the path's next module, or after it (OPT declares its decoder's
    final_layer_norm before its layers, and runs it after them)."""
    first, last, found = [], [], []
    path = stack.split(".") if stack else []
    prefix, module = "", model
    for depth in range(len(path) + 1):
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if own:
            where = prefix or "the model"
            found.append(
                Diagnostic(
                    SL214,
                    f"{where} holds parameters of its own ({few(own)}), outside every stage",
                    pipeline.split_span,
                    ("move them into a submodule that runs before or after the stack",),
                )
            )
        if depth == len(path):
            break
        step = path[depth]
        before = True
        for name, child in module.named_children():
            fqn = f"{prefix}.{name}" if prefix else name
            if name == step:
                before = False
                continue
            if any(True for _ in child.parameters()):
                runs_before = ran_before(fqn)
                (first if (before if runs_before is None else runs_before) else last).append(fqn)
        prefix = f"{prefix}.{step}" if prefix else step
        module = module.get_submodule(step)
    return tuple(first), tuple(last), found


def _shared(model: nn.Module, stages: Stages, pipeline: ir.Pipeline) -> list[Diagnostic]:
    """SL214: a parameter (a tied weight) that modules of two stages hold."""
    owners: dict[int, dict[int, str]] = {}
    for fqn, module in model.named_modules():
        stage = stages.stage_of(fqn)
        if stage is None:
            continue
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), {}).setdefault(stage, f"{fqn}.{name}")
    found = []
    for held in owners.values():
        if len(held) > 1:
            names = [f"{n} (stage {s})" for s, n in sorted(held.items())]
            found.append(
                Diagnostic(
                    SL214,
                    f"one parameter is held by two stages: {', '.join(names)}",
                    pipeline.split_span,
                    (
                        "untie it (for Hugging Face models, tie_word_embeddings=False in the config), "
                        "or keep its modules in one stage",
                    ),
                )
            )
    return found
