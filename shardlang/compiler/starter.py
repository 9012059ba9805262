"""A starter plan for a model (`shardlang init`): FSDP2 units on the blocks of its longest repeated stack
and the root, tensor parallelism translated rule by rule from a Hugging Face model's own TP plan, bf16
mixed precision, `init meta` and the default checks. The text is meant to be read and edited.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.nn as nn

from ..frontend.patterns import modules_matching, pattern_regex

#: Hugging Face TP styles (transformers' ParallelInterface names) and the shardlang style that does the
#: same (docs/language.md §4.2 has what each does), or None where no style does (the rule is written as a
#: comment saying why, WHY_NOT). The README's table is this one.
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
    "moe_tp_experts": None,
    "moe_identity_expert": None,
    "mla_kv_a_proj": None,
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
}
WHY_NOT = {
    "replicate": "every rank keeps the whole tensor: no rule needed",
    "packed_rowwise": "3-D expert tensors stored [experts, hidden, 2 x width]: no built-in style",
    "moe_tp_experts": "no built-in style: the experts stay whole on each tp rank; fully_shard shards them over dp",
    "moe_identity_expert": "goes with moe_tp_experts: no built-in style",
    "mla_kv_a_proj": "MLA's rotary slice with its gradient summed over tp: no built-in style",
    "local_params": "a module run on its local shards: no built-in style",
    "ep_dispatch_experts": "expert parallelism (experts spread over ranks): no built-in style",
    "grouped_gemm": "expert parallelism (experts spread over ranks): no built-in style",
    "ep_router": "expert parallelism (experts spread over ranks): no built-in style",
    "isolated": "expert parallelism (experts spread over ranks): no built-in style",
    # older transformers: shards kept as plain tensors, their partial sums reduced by a `gather` above
    **dict.fromkeys(
        ("local_colwise", "local_rowwise", "local_packed_rowwise", "local", "gather"),
        "plain-tensor shards summed by a `gather` module above (older transformers): no built-in style",
    ),
}
PARAMETER_RULE = "a parameter, not a module: its module's rule says how it is laid out"
NO_MODULE = "no such module in this model"


def longest_stack(model: nn.Module) -> str | None:
    """The FQN of the container (ModuleList, Sequential, ModuleDict) with the most children of one class
    (at least 2): the model's repeated blocks."""
    best, size = None, 1
    for fqn, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            children = list(module.children())
            if len(children) > size and len({type(c) for c in children}) == 1:
                best, size = fqn, len(children)
    return best


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """A transformers model's TP plan with keys relative to `model`: the config's `base_model_tp_plan`
    (relative to the base model, e.g. `model.`) and the model class's own `_tp_plan` (e.g. lm_head)."""
    config = getattr(model, "config", None)
    plan: dict[str, str] = {}
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    for key, style in base.items():
        plan[prefix + key] = style
    for key, style in (getattr(model, "_tp_plan", None) or {}).items():
        if not key.startswith(prefix) or key not in plan:
            plan[key] = style
    return plan


def translate(model: nn.Module, key: str, style: str) -> tuple[str | None, str]:
    """One rule of a transformers TP plan as (shardlang style, "") or (None, why it stays a comment)."""
    if not modules_matching(model, key):
        regex = pattern_regex(key)
        params = any(regex.fullmatch("." + name) for name, _ in model.named_parameters())
        return None, PARAMETER_RULE if params else NO_MODULE
    ours = HF_STYLES.get(style)
    if ours is None:
        return None, WHY_NOT.get(style, "no shardlang style does this")
    return ours, ""


def init_plan(model: nn.Module, *, tp: int = 1, dp: int | None = None, name: str = "the model") -> str:
    """A commented starter plan for `model` (built on any device, meta included) at `tp`-way tensor
    parallelism (1: none) and `dp`-way data parallelism (None: whatever the world leaves)."""
    stack = longest_stack(model)
    tp_plan = hf_tp_plan(model) if tp > 1 else {}
    dims = [f"dp={dp if dp else 'auto'}"] + ([f"tp={tp}"] if tp > 1 else [])
    lines = [
        f"# Starter plan for {name}, written by `shardlang init`: read it, then edit it.",
        "shardlang 1",
        "",
        f"mesh world = auto[{', '.join(dims)}]",
    ]
    if tp > 1:
        if tp_plan:
            lines += [
                "",
                "# Tensor parallelism, from the model's own tp_plan (transformers).",
                "parallelize on world.tp {",
            ]
            width = max(len(k) for k in tp_plan)
            for key, style in tp_plan.items():
                ours, why = translate(model, key, style)
                if ours is None:
                    lines.append(f"    # {key:<{width}} : {style}: {why}")
                else:
                    lines.append(f"    {key:<{width}} : {ours}")
            lines.append("}")
        else:
            lines += ["", "# --tp asked for, but the model carries no tp_plan: write parallelize rules by hand."]
    lines += ["", "# FSDP2: one unit per repeated block, and the root (the rest)."]
    lines.append("fully_shard on world.dp {")
    if stack is not None:
        lines.append(f"    each {stack}.*")
    lines += ["    mixed_precision(param=bf16, reduce=fp32)", "}"]
    lines += [
        "",
        "# Parameters on the meta device, each shard initialised on its own rank by the model's own",
        "# initialisers; buffers computed at construction are kept.",
        "init meta",
        "",
        "# No verify statement: apply runs all six checks.",
        "",
    ]
    return "\n".join(lines)
