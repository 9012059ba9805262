"""A starter plan for a model (`shardlang init`): FSDP2 units on the blocks of its stack of repeated
blocks (the one holding the most parameters) and the root, tensor parallelism translated rule by rule from a Hugging Face model's own TP plan
(or proposed from the structure of a model without one: proposed.py), bf16
mixed precision, `init meta` and the default checks. The text is meant to be read and edited.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

import torch.nn as nn

from ..frontend.ir import Init
from ..frontend.patterns import modules_matching, pattern_regex, within
from .dropping import Drops
from .initialisers import is_hugging_face
from .predict import expert_tp_layout, stacked_experts
from .proposed import proposed_tp_groups, with_partners
from .trace import Order

#: Hugging Face TP styles (transformers' ParallelInterface names) and the shardlang style that does the
#: same (docs/language.md §4.2 has what each does), or None where no style does (the rule is written as a
#: comment saying why, WHY_NOT). docs/huggingface.md's table is this one.
HF_STYLES: Mapping[str, str | None] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather_output",
    "colwise_rep": "colwise_gather_output",
    "rowwise_split_input": "rowwise_split_input",
    "rowwise_rep": "rowwise_split_input",
    "packed_colwise": "packed_colwise",
    "replicated_with_grad_allreduce": "replicated_with_grad_allreduce",
    # transformers' SequenceParallel hands on local tensors; torch's (and so shardlang's) default is DTensors
    "sequence_parallel": "sequence_parallel(local_output=true)",
    # token ids replicated: the vocabulary split over tp and the partial lookups summed, or the hidden dim
    # split and the slices gathered
    "embedding_rowwise": "rowwise(input=replicate)",
    "embedding_colwise": "colwise_gather_output",
    "embedding_colwise_gather_output": "colwise_gather_output",
    "all_reduce": "prepare_output(output=partial, desired=replicate)",  # sum the module's partial output
    "replicate": None,
    "packed_rowwise": None,
    "moe_tp_experts": "expert_tensor_parallel",
    "moe_identity_expert": None,
    "mla_kv_a_proj": "mla_kv_a_proj(rope={rope})",  # rope: the config's qk_rope_head_dim (translate)
    "local_params": None,
    "local_colwise": None,
    "local_rowwise": None,
    "local_packed_rowwise": None,
    "local": None,
    "gather": None,
    "isolated": None,
    "ep_router": None,
    "ep_dispatch_experts": None,
    "grouped_gemm": None,
    # heads kept whole: the same as colwise/rowwise where the module's heads divide over tp (translate)
    "unit_colwise": "colwise",
    "unit_rowwise": "rowwise",
}
#: The transformers styles that keep each attention head whole on a rank, and the projection dim counting heads.
UNIT_STYLES = {"unit_colwise": "out_features", "unit_rowwise": "in_features"}
WHY_NOT = {
    "replicate": "every rank keeps the whole tensor: no rule needed",
    "packed_rowwise": "3-D expert tensors stored [experts, hidden, 2 x width]: no built-in style",
    "moe_identity_expert": "an identity expert beside moe_tp_experts: no built-in style",
    "local_params": "a module run on its local shards: no built-in style",
    "ep_dispatch_experts": "expert parallelism: `shardlang init --ep N` writes expert_parallel",
    "grouped_gemm": "expert parallelism: `shardlang init --ep N` writes expert_parallel",
    "ep_router": "expert parallelism (experts spread over ranks): no built-in style",
    "isolated": "expert parallelism (experts spread over ranks): no built-in style",
    # older transformers: shards kept as plain tensors, their partial sums reduced by a `gather` above
    **dict.fromkeys(
        ("local_colwise", "local_rowwise", "local_packed_rowwise", "local", "gather"),
        "plain-tensor shards summed by a `gather` module above (older transformers): no built-in style",
    ),
}
#: The comment over rules proposed from a model's structure (compiler.proposed), where it has no tp_plan.
PROPOSED_HEADER = [
    "# Tensor parallelism, proposed from the model's structure (it carries no tp_plan of its own): each",
    "# attention's q, k, v and each MLP's gate and up column-wise, their output and down row-wise, the token",
    "# embedding split by vocabulary and the logits gathered, so every activation between them is whole.",
]
PARAMETER_RULE = "a parameter, not a module: its module's rule says how it is laid out"
NO_MODULE = "no such module in this model"
#: The style init adds for a module whose whole parameters lint's step found meeting a piece of its input.
SUMMED = "replicated_with_grad_allreduce"
ADDED = "added: lint's simulated step found its whole parameters meeting a piece of its input"


def block_stacks(model: nn.Module, order: Order | None = None) -> tuple[str, ...]:
    """The FQNs of the model's stacks of repeated blocks, where FSDP units go: containers (ModuleList,
    ModuleDict, Sequential) of at least two children of one class, each holding parameters. The stack
    holding the most parameters (a decoder's layers, not the per-head norms inside each layer's
    attention, which are more numerous but tiny), and any other outside it holding at least half as many
    (an encoder's and a decoder's). With a traced `order`, only stacks whose every block ran its forward
    (a unit whose forward never runs never gathers its parameters), in training or, skipped at random by
    the traced draw (LayerDrop), in eval mode. In the order the model declares them."""
    ran = {*order.modules, *order.skipped} if order is not None and order.modules is not None else None
    sizes = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        if not all(_holds_parameters(c) for _, c in children):
            continue
        if ran is not None and not all(_child(fqn, name) in ran for name, _ in children):
            continue
        sizes[fqn] = sum(p.numel() for p in module.parameters())
    chosen: list[str] = []
    for fqn in sorted(sizes, key=lambda f: -sizes[f]):  # stable: ties keep declaration order
        if chosen and sizes[fqn] * 2 < sizes[chosen[0]]:
            break
        if not any(_nested(fqn, other) or _nested(other, fqn) for other in chosen):
            chosen.append(fqn)
    return tuple(f for f in sizes if f in chosen)


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _child(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def _nested(inner: str, outer: str) -> bool:
    return not outer or inner.startswith(outer + ".")


def attention_patterns(model: nn.Module, stacks: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    """The patterns of each stack's attention modules, for context_parallel: in the first block of each
    stack, the outermost module whose class name ends in "Attention" (transformers' `self_attn`,
    torchtitan's `attention`), as `stack.*.path`; and, if there is none, why. A transformers model must
    run SDPA (attn_implementation="sdpa"), which context parallelism takes over."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in (None, "sdpa"):
        return (), (
            f"its attention runs '{implementation}', and context parallelism takes over "
            "scaled_dot_product_attention (build it with attn_implementation='sdpa')"
        )
    patterns = []
    for stack, outermost in _outermost_in_first_blocks(model, stacks, lambda m: type(m).__name__.endswith("Attention")):
        patterns += [f"{stack}.*.{path}" for path in outermost[:1]]
    if not patterns:
        return (), "no block of the model holds a module whose class name ends in Attention"
    return tuple(patterns), ""


def hf_tp_plan(model: nn.Module, kind: str = "tp") -> dict[str, str]:
    """A transformers model's TP plan with keys relative to `model`: the config's `base_model_tp_plan`
    (relative to the base model, e.g. `model.`) and the model class's own `_tp_plan` (e.g. lm_head).
    `kind="ep"`: its expert-parallel plan (`base_model_ep_plan`, `_ep_plan`) instead."""
    config = getattr(model, "config", None)
    plan: dict[str, str] = {}
    base = getattr(config, f"base_model_{kind}_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    for key, style in base.items():
        plan[prefix + key] = style
    for key, style in (getattr(model, f"_{kind}_plan", None) or {}).items():
        if not key.startswith(prefix) or key not in plan:
            plan[key] = style
    return plan


def translate(model: nn.Module, key: str, style: str, tp: int = 1) -> tuple[str | None, str]:
    """One rule of a transformers TP plan as (shardlang style, "") or (None, why it stays a comment), at
    tensor-parallel degree `tp`."""
    if not modules_matching(model, key):
        regex = pattern_regex(key)
        params = any(regex.fullmatch("." + name) for name, _ in model.named_parameters())
        return None, PARAMETER_RULE if params else NO_MODULE
    ours = HF_STYLES.get(style)
    if ours is None:
        return None, WHY_NOT.get(style, "no shardlang style does this")
    if ours == "expert_tensor_parallel":
        for fqn in modules_matching(model, key):
            layout = expert_tp_layout(model.get_submodule(fqn), 1)
            if isinstance(layout, str):
                return None, f"{layout}; the experts stay whole on each tp rank and fully_shard shards them over dp"
    if style in UNIT_STYLES:
        return _whole_heads(model, key, style, ours, tp)
    if "{rope}" in ours:
        config = getattr(model, "config", None)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        rope = getattr(config, "qk_rope_head_dim", None)
        if rope is None:
            return None, "mla_kv_a_proj needs the rotary width, and the model's config has no qk_rope_head_dim"
        return ours.format(rope=rope), ""
    return ours, ""


def _whole_heads(model: nn.Module, key: str, style: str, ours: str, tp: int) -> tuple[str | None, str]:
    """transformers' unit_colwise/unit_rowwise, which keep each head whole: colwise/rowwise where every
    matched projection's heads divide over tp; with fewer heads than ranks transformers repeats each head on
    several ranks over a second mesh axis, which no built-in style does."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if not head_dim:
        return None, f"{style} splits by head, and the model's config gives no head_dim"
    for fqn in modules_matching(model, key):
        width = getattr(model.get_submodule(fqn), UNIT_STYLES[style], None)
        if width is None or width % head_dim:
            return None, f"{style} on {fqn}: not a projection of whole heads of width {head_dim}"
        if (width // head_dim) % tp:
            return None, (
                f"{style} on {fqn}: its {width // head_dim} heads do not divide over tp={tp} (transformers "
                "repeats each head on several ranks over a second mesh axis): no built-in style"
            )
    return ours, ""


#: transformers' expert-parallel styles (its `base_model_ep_plan`) and shardlang's: the experts module is
#: split by `expert_parallel`; its stacked tensors (`grouped_gemm`) go with it.
HF_EP_STYLES: Mapping[str, str | None] = {"ep_dispatch_experts": "expert_parallel", "grouped_gemm": None}


def _ep_rules(model: nn.Module) -> list[tuple[str, str, str | None, str]]:
    """The model's ep_plan as (key, style, shardlang style or None, why not)."""
    rules = []
    for key, style in hf_tp_plan(model, "ep").items():
        if not modules_matching(model, key):  # a parameter (grouped_gemm), or a module this model lacks
            rules.append((key, style, None, translate(model, key, style)[1]))
            continue
        ours = HF_EP_STYLES.get(style)
        rules.append((key, style, ours, "" if ours else "no shardlang style does this"))
    return rules


def _stacked_expert_rules(model: nn.Module, stacks: tuple[str, ...]) -> list[tuple[str, str, str | None, str]]:
    """For a model without transformers' ep_plan (torchtitan's, a model's own): each module of a stack's
    first block holding experts stacked on dim 0 (torchtitan's grouped experts), as `stack.*.path` rules
    of `expert_parallel`, in _ep_rules' form; the outermost such modules only."""
    return [
        (f"{stack}.*.{path}", "stacked experts", "expert_parallel", "")
        for stack, outermost in _outermost_in_first_blocks(model, stacks, stacked_experts)
        for path in outermost
    ]


#: Why init splits experts by width that the model's tp_plan leaves whole.
EXPERTS_WHOLE = "added: the model's tp_plan leaves these experts whole on every tp rank; split by width"


def _experts_by_width(model: nn.Module, stacks, rules, split, tp: int) -> list[tuple[str, str, str | None, str]]:
    """`expert_tensor_parallel` rules for the stacked experts of each stack's first block that no rule of
    `rules` names (nor splits a module inside them) and expert parallelism does not split (`split`), where
    their layout divides over `tp`: without it every tp rank would hold every expert whole."""
    named = [key for key, _, ours, _ in rules if ours is not None]
    added = []
    for stack, outermost in _outermost_in_first_blocks(model, stacks, stacked_experts):
        first = next(iter(model.get_submodule(stack).named_children()))[1]
        for path in outermost:
            pattern = f"{stack}.*.{path}"
            if any(within(key, pattern) for key in named + list(split)) or any(k == pattern for k, *_ in rules):
                continue
            if not isinstance(expert_tp_layout(first.get_submodule(path), tp), str):
                added.append((pattern, "stacked experts", "expert_tensor_parallel", EXPERTS_WHOLE))
    return added


def _outermost_in_first_blocks(model: nn.Module, stacks: tuple[str, ...], matches) -> list[tuple[str, list[str]]]:
    """For each stack with a block, (stack, the paths inside its first block of the outermost modules that
    `matches`, in module order): what a `stack.*.path` pattern names in every block."""
    found_in = []
    for stack in stacks:
        first = next(iter(model.get_submodule(stack).named_children()), None)
        if first is None:
            continue
        found = [n for n, m in first[1].named_modules() if n and matches(m)]
        found_in.append((stack, [n for n in found if not any(within(n, other) and n != other for other in found)]))
    return found_in


#: The methods with which a model that is not transformers' initialises itself whole, which `init meta
#: with` calls on the root as build_model() does (torchtitan's `init_states`, older torchtitan's and many
#: codebases' `init_weights`), in the order they are preferred.
ROOT_INITIALISERS = ("init_states", "init_weights")


def root_initialiser(model: nn.Module) -> str | None:
    """The model's own whole-model initialiser (ROOT_INITIALISERS), if it has one and is not transformers'
    (whose `init_weights` is the per-module `_init_weights` that plain `init meta` already calls)."""
    if is_hugging_face(model):
        return None
    return next((name for name in ROOT_INITIALISERS if callable(getattr(model, name, None))), None)


def _init_lines(
    method: str | None, unwritten: Sequence[str], failed: Mapping[str, str], pipelined: bool = False
) -> list[str]:
    """The init statement and its comment: `init meta with METHOD` where the root has a whole-model
    initialiser, else `init meta`, else `init rank0` (rank 0 builds the model as build_model() does), the
    first whose init check did not fail (`failed`, from init's apply), and `init rank0` at once where init
    meta's initialisers leave parameters unwritten (SL224). `pipelined`: `init cpu` where it would write
    `init rank0`, which a pipeline's stages cannot take (SL216)."""
    if unwritten:
        said = (
            f"Not `init meta`: the model's initialisers leave {len(unwritten)} parameter"
            f"{'s' if len(unwritten) > 1 else ''} unwritten, whose values only its constructor computes "
            f"({', '.join(unwritten[:3])}{', ...' if len(unwritten) > 3 else ''}; SL224). "
            + (
                "Each rank builds the model on its CPU as build_model() does (not rank 0 alone: each pipeline "
                "stage holds other tensors) and keeps its own part."
                if pipelined
                else "Rank 0 builds the model on its CPU and sends each rank its shards."
            )
        )
        return [*(f"# {line}" for line in textwrap.wrap(said, 98)), "init cpu" if pipelined else "init rank0"]
    tried = [f"Not `{key}`: its init check failed ({why})." for key, why in failed.items()]
    said = [f"# {line}" for text in tried for line in textwrap.wrap(text, 98)]
    if method is not None and str(Init("meta", method)) not in failed:
        return [
            *said,
            f"# Parameters on the meta device, initialised on their ranks by the model's own `{method}()`, called",
            "# on the root as a whole-model initialiser is (if build_model() initialises another way, say which).",
            f"init meta with {method}",
        ]
    if str(Init("meta")) not in failed:
        return [
            *said,
            "# Parameters on the meta device, each shard initialised on its own rank by the model's own",
            "# initialisers; buffers computed at construction are kept.",
            "init meta",
        ]
    if pipelined:
        return [*said, "# Each rank builds the model on its CPU as build_model() does and keeps its part.", "init cpu"]
    return [*said, "# Rank 0 builds the model as build_model() does and sends each rank its shards.", "init rank0"]


def _left_out(rules, dropped: Mapping[str, str]) -> list[tuple[str, str, str | None, str]]:
    """`rules` (init_plan's 4-tuples) with those whose key `dropped` names turned into comments saying why."""
    return [
        (key, style, None, f"left out (lint's simulated step: {dropped[key]})")
        if key in dropped and ours is not None
        else (key, style, ours, why)
        for key, style, ours, why in rules
    ]


def _sums_written(rules) -> list[tuple[str, str, str | None, str]]:
    """`rules` with each `all_reduce` (a module's partial output summed) turned into a comment where no
    rule inside that module is written: its partial output comes only from them (Inkling's shared experts,
    whose projections are parameters of one module, not modules), and summing a whole output over tp
    would multiply it by tp."""
    kept = [key for key, _, ours, _ in rules if ours is not None]
    return [
        (key, style, None, "it sums a partial output that only the rules inside it make, and none of them is written")
        if style == "all_reduce" and ours is not None and not any(within(k, key) and k != key for k in kept)
        else (key, style, ours, why)
        for key, style, ours, why in rules
    ]


def _sibling_groups(rules) -> list[list[tuple]]:
    """A model's own tp_plan rules grouped by the module that holds them (an attention's q/k/v/o, an MLP's
    gate/up/down): a rule lint's step leaves out takes its siblings with it (compiler.proposed.with_partners),
    since a column-wise projection without its row-wise partner hands the model a split activation."""
    groups: dict[str, list[tuple]] = {}
    for rule in rules:
        groups.setdefault(rule[0].rpartition(".")[0], []).append(rule)
    return [group for group in groups.values() if len(group) > 1]


def _rule_lines(rules) -> list[str]:
    """A parallelize block's body: each (key, transformers style, ours, why not) a rule, or a comment
    saying why there is none, the names aligned."""
    width = max(len(key) for key, *_ in rules)
    lines = []
    for key, style, ours, why in rules:
        if ours is None:
            lines.append(f"    # {key:<{width}} : {style}: {why}")
        else:  # a rule init added says why above it
            lines += [f"    # {key}: {why}"] if why else []
            lines.append(f"    {key:<{width}} : {ours}")
    return lines


def init_plan(
    model: nn.Module,
    *,
    tp: int = 1,
    dp: int | None = None,
    ep: int = 1,
    cp: int = 1,
    pp: int = 1,
    microbatches: int | None = None,
    name: str = "the model",
    order: Order | None = None,
    unwritten: Sequence[str] = (),
    drops: Drops | None = None,
) -> str:
    """A commented starter plan for `model` (built on any device, meta included) at `tp`-way tensor
    parallelism (1: none), `dp`-way data parallelism (None: whatever the world leaves) and `ep`-way expert
    parallelism (1: none; the ep ranks borrow data-parallel ones, FSDP over `world[dp*ep]`). Every mesh
    dim it writes is used by a statement: without a rule to shard over tp (no TP plan, or none of its
    styles has an equivalent), there is no tp dim, and a comment says why (SL217); likewise ep. `order`:
    the order the model's modules run in (compiler.trace), to keep FSDP units off stacks whose blocks
    never run. `cp`-way context parallelism (1: none) over each block's attention module
    (`attention_patterns`); the cp ranks reduce with the data-parallel ones. `unwritten`: the parameters
    that `init meta`'s initialisers leave unwritten (explain.unwritten.left_unwritten): then `init rank0`,
    which keeps what the constructor computed, and a comment naming them. `drops`: what lint's step found
    cannot run (compiler.dropping), each left out with a comment saying why. `pp`-way pipeline parallelism
    (1: none) cuts the one stack of blocks into `pp` stages of consecutive blocks under 1F1B, over
    `microbatches` micro-batches (None: the language's default, one per stage), where `unpipelinable` finds
    nothing against it."""
    drops = drops or Drops()
    stacks = block_stacks(model, order)
    no_pipeline = (drops.pp or unpipelinable(model, stacks, pp)) if pp > 1 else None
    keeps_pp = pp > 1 and no_pipeline is None
    experts = _ep_rules(model) if ep > 1 else []
    from_ep_plan = any(ours is not None for _, _, ours, _ in experts)
    if ep > 1 and not from_ep_plan:
        experts = _stacked_expert_rules(model, stacks) or experts
    experts = _left_out(experts, drops.rules)
    keeps_ep = any(ours is not None for _, _, ours, _ in experts)
    split = [key for key, _, ours, _ in experts if ours is not None]
    rules = (
        [(key, style, *translate(model, key, style, tp)) for key, style in hf_tp_plan(model).items()] if tp > 1 else []
    )
    proposed = tp > 1 and not rules  # no tp_plan of its own: rules read off its structure (compiler.proposed)
    groups = proposed_tp_groups(model, stacks, tp) if proposed else _sibling_groups(rules)
    rules = [rule for group in groups for rule in group] if proposed else rules
    # Tensor parallelism inside the experts expert parallelism splits: not both (expert_tensor_parallel
    # and expert_parallel on one module: not yet).
    rules = [
        (key, style, None, "the experts are split over ep instead")
        if any(within(key, e) for e in split)
        else (key, style, ours, why)
        for key, style, ours, why in rules
    ]
    rules += _experts_by_width(model, stacks, rules, split, tp) if tp > 1 else []
    rules = _sums_written(_left_out(rules, with_partners(groups, drops.rules)))  # a rule takes its group
    if tp > 1:  # modules whose whole parameters lint's step found meeting a piece of their input
        rules += [(key, SUMMED, SUMMED, ADDED) for key in drops.summed if key not in drops.rules]
    keeps_tp = any(ours is not None for _, _, ours, _ in rules)
    attention, no_attention = attention_patterns(model, stacks) if cp > 1 else ((), "")
    if drops.cp:
        attention, no_attention = (), f"lint's simulated step says: {drops.cp}"
    keeps_cp = bool(attention)
    dims = ([f"pp={pp}"] if keeps_pp else []) + [f"dp={dp if dp else 'auto'}"] + ([f"ep={ep}"] if keeps_ep else [])
    dims += ([f"cp={cp}"] if keeps_cp else []) + ([f"tp={tp}"] if keeps_tp else [])
    lines = [
        f"# Starter plan for {name}, written by `shardlang init`: read it, then edit it.",
        "shardlang 1",
        "",
        f"mesh world = auto[{', '.join(dims)}]",
    ]
    lines += _pipeline_lines(stacks, pp, microbatches, no_pipeline) if pp > 1 else []
    if keeps_tp:
        lines += [
            "",
            *(PROPOSED_HEADER if proposed else ["# Tensor parallelism, from the model's own tp_plan (transformers)."]),
            "parallelize on world.tp {",
            *_rule_lines(rules),
            "}",
        ]
    elif tp > 1:
        why = "none of its rules has a shardlang style" if rules else "the model carries no tp_plan of its own"
        why = "it carries no tp_plan of its own and no rule proposed from its structure fits it" if proposed else why
        if any(reason.startswith("left out") for *_, reason in rules):
            why = "lint's simulated step found that none of its rules runs"
        said = (
            f"--tp {tp} asked for, but {why}: no tensor parallelism, and so no tp dim (a mesh dim that no "
            "statement uses trains its ranks on different data and never averages them: SL217). To add it, "
            f"write `parallelize ... on world.tp` rules and put `tp={tp}` in the mesh."
        )
        lines += ["", *(f"# {line}" for line in textwrap.wrap(said, 98))]
        lines += [f"#     {key} : {style}: {reason}" for key, style, _, reason in rules]
    if keeps_ep:
        lines += [
            "",
            "# Expert parallelism, from the model's own ep_plan (transformers): each layer's experts split over"
            if from_ep_plan
            else "# Expert parallelism on the modules holding experts stacked on dim 0: each layer's experts split over",
            "# ep, each rank's tokens sent to their experts' ranks and back. The ep ranks train on their own data:",
            "# fully_shard below spreads over dp*ep, and the experts get their own unit over dp.",
            "parallelize on world.ep {",
            *_rule_lines(experts),
            "}",
        ]
    elif ep > 1:
        said = (
            f"--ep {ep} asked for, but the model carries no ep_plan with an experts module and no module holds "
            "experts stacked on dim 0: no expert parallelism, and so no ep dim (SL217)."
        )
        lines += ["", *(f"# {line}" for line in textwrap.wrap(said, 98))]
    if keeps_cp:
        lines += [
            "",
            "# Context parallelism: each sequence split over cp (head-tail balanced), each block's attention",
            "# computing its shard's queries against the whole sequence's keys and values. The cp ranks",
            "# compute the gradients of their own tokens: fully_shard below reduces over them too.",
            "context_parallel on world.cp {",
            *(f"    each {pattern}" for pattern in attention),
            "}",
        ]
    elif cp > 1:
        said = f"--cp {cp} asked for, but {no_attention}: no context parallelism, and so no cp dim (SL217)."
        lines += ["", *(f"# {line}" for line in textwrap.wrap(said, 98))]
    lines += ["", "# FSDP2: one unit per repeated block, and the root (the rest)."]
    if not stacks:
        lines.append("# No stack of repeated blocks with parameters was found: the root is the only unit.")
    reduced = ["dp"] + (["ep"] if keeps_ep else []) + (["cp"] if keeps_cp else [])
    over = "[" + "*".join(reduced) + "]" if len(reduced) > 1 else ".dp"
    for unit, why in drops.units.items():
        said = f"{unit} are not units, the root holds them (lint's simulated step: {why})."
        lines += [f"# {line}" for line in textwrap.wrap(said, 98)]
    if drops.mixed_precision:
        said = f"No mixed_precision (lint's simulated step, with bf16 parameters: {drops.mixed_precision})."
        lines += [f"# {line}" for line in textwrap.wrap(said, 98)]
    lines += _skipped_lines(stacks, order)
    lines.append(f"fully_shard on world{over} {{")
    lines += [f"    each {stack}.*" for stack in stacks if f"{stack}.*" not in drops.units]
    lines += [] if drops.mixed_precision else ["    mixed_precision(param=bf16, reduce=fp32)"]
    lines += ["}"]
    lines += ["", *_init_lines(root_initialiser(model), unwritten, drops.inits, keeps_pp)]
    lines += [
        "",
        "# No verify statement: apply runs all six checks.",
        "",
    ]
    return "\n".join(lines)


def _skipped_lines(stacks: Sequence[str], order: Order | None) -> list[str]:
    """A comment on each stack whose blocks training skips at random (LayerDrop): FSDP's collectives pair
    only where every rank skips alike."""
    skipped = [s for s in stacks if order is not None and any(_nested(m, s) for m in order.skipped)]
    if not skipped:
        return []
    said = (
        f"Blocks of {', '.join(f'`{s}`' for s in skipped)} are skipped at random in training (LayerDrop: "
        "some ran in eval mode and not in a training forward). Each is still a unit: every rank must skip "
        "alike (one random seed on every rank, the same draws before each block), or a rank waits in a "
        "collective of a block the others skipped."
    )
    return [f"# {line}" for line in textwrap.wrap(said, 98)]


def unpipelinable(model: nn.Module, stacks: Sequence[str], pp: int) -> str | None:
    """Why `model` cannot be cut into `pp` pipeline stages as init writes them (the blocks of its one stack
    in consecutive stages, what runs before them on the first stage, what runs after on the last), or None
    where it can: more than one stack (an encoder and a decoder), fewer blocks than stages, or a parameter
    shared between modules that would sit on two stages (a tied embedding and output layer: SL214)."""
    if len(stacks) != 1:
        found = "no stack of repeated blocks" if not stacks else f"{len(stacks)} stacks of blocks ({', '.join(stacks)})"
        return f"it has {found}; init pipelines one"
    blocks = len(model.get_submodule(stacks[0])._modules)
    if blocks < pp:
        return f"its {blocks} blocks cannot make {pp} stages"
    owners: dict[int, set[str]] = {}
    prefix = stacks[0] + "."
    for fqn, parameter in model.named_parameters(remove_duplicate=False):
        inside = fqn.startswith(prefix)
        # within a block a shared parameter stays on one stage; elsewhere its module is where it lives
        owner = prefix + fqn[len(prefix) :].split(".", 1)[0] if inside else fqn.rsplit(".", 1)[0]
        owners.setdefault(id(parameter), set()).add(owner)
    shared = next((sorted(o) for o in owners.values() if len(o) > 1), None)
    if shared:
        return f"{' and '.join(shared[:2])} share a parameter (tied), which two stages cannot hold (SL214)"
    return None


def _pipeline_lines(stacks: Sequence[str], pp: int, microbatches: int | None, no_pipeline: str | None) -> list[str]:
    """The `pipeline` block init writes (or, where `no_pipeline` says why not, a comment)."""
    if no_pipeline is not None:
        said = f"--pp {pp} asked for, but {no_pipeline}: no pipeline, and so no pp dim (SL217)."
        return ["", *(f"# {line}" for line in textwrap.wrap(said, 98))]
    stack = stacks[0]
    count = f"{microbatches} micro-batches" if microbatches else "one micro-batch per stage"
    return [
        "",
        f"# Pipeline: the blocks of {stack} in {pp} stages of consecutive blocks, the first stage also running",
        "# what comes before them, the last what comes after (and the loss); torch's 1F1B schedule over",
        f"# {count}. Inside each stage the statements below apply as to a whole model.",
        "pipeline on world.pp {",
        f"    split {stack}.* into auto",
        "    schedule = 1f1b",
        *([f"    microbatches = {microbatches}"] if microbatches else []),
        "}",
    ]
