"""A starter plan for a model (`shardlang init`): FSDP2 units on the blocks of its longest repeated stack
and the root, tensor parallelism translated rule by rule from a Hugging Face model's own TP plan, bf16
mixed precision, `init meta` and the default checks. The text is meant to be read and edited.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.nn as nn

#: Hugging Face TP styles (transformers' ParallelInterface names) and the shardlang style that does the
#: same, or None where no built-in style does (the rule is written as a comment saying why).
HF_STYLES: Mapping[str, str | None] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_rep": "colwise(output=replicate)",
    "colwise_gather_output": "colwise(output=replicate)",
    "rowwise_rep": "rowwise(input=replicate)",
    "rowwise_split_input": "rowwise(input=replicate)",
    "sequence_parallel": "sequence_parallel",
    "embedding_rowwise": "rowwise(input=replicate)",  # the vocabulary split over tp, token ids replicated
    "embedding_colwise": "colwise(input=replicate)",
    "embedding_colwise_gather_output": "colwise(input=replicate, output=replicate)",
    "all_reduce": None,
    "replicate": None,
    "local_params": None,
    "mla_kv_a_proj": None,
    "moe_tp_experts": None,
    "moe_identity_expert": None,
    "ep_dispatch_experts": None,
    "local_colwise": None,
    "local_rowwise": None,
    "local_packed_rowwise": None,
    "packed_colwise": None,
    "packed_rowwise": None,
    "local": None,
    "gather": None,
    # Per-head q/k norms: each TP rank normalises its own heads ([batch, seq, heads, head_dim], heads on
    # dim 2) with the replicated weight, and DTensor sums the weight's partial gradients over tp.
    "replicated_with_grad_allreduce": "distribute(input=shard(2), output=local)",
    "isolated": None,
    "ep_router": None,
    "grouped_gemm": None,
}
WHY_NOT = {
    "packed_colwise": "fused gate/up (or qkv) projections split per part: no built-in style yet",
    "packed_rowwise": "fused projections split per part: no built-in style yet",
}


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
                ours = HF_STYLES.get(style)
                if ours is None:
                    why = WHY_NOT.get(style, "no shardlang style does this yet")
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
