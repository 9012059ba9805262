"""Styles that do not fit (SL202, SL207): a style on the wrong module type, loss_parallel without its output layer."""

from __future__ import annotations

from collections import defaultdict

import torch.nn as nn

from ...frontend import ir
from ...frontend.diagnostics import SL202, SL207, Diagnostic, few
from ..predict import expert_members, expert_tp_layout, stacked_experts, style_kind
from ..resolve import Resolution
from .common import Predictions, Shapes, dim_sizes

#: Styles that shard an nn.Linear (or nn.Embedding) through torch's ColwiseParallel / RowwiseParallel.
LINEAR_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")
CONV1D_STYLES = ("colwise_conv1d", "rowwise_conv1d")


def style_module_types(
    plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes
) -> list[Diagnostic]:
    """SL202: a style on a module it cannot shard (colwise/rowwise on anything but Linear and Embedding,
    the Conv1D styles on anything but a layer with a 2-D [in, out] weight, packed_colwise on anything but
    a Linear whose rows split into its parts), or sequence_parallel / replicated_with_grad_allreduce on a
    module with parameters below it. The help says which style fits instead. One diagnostic per rule."""
    sizes = dim_sizes(plan, shapes)
    wrong: dict[ir.Rule, list] = defaultdict(list)
    for match in resolution.rules:
        module = resolution.modules[match.fqn]
        mesh = plan.parallelize[match.block].mesh
        why = _misfit(match.rule.style, module, sizes.get((mesh.mesh, mesh.dims[0]), 1))
        if why is not None:
            wrong[match.rule].append((match.fqn, module, why))
    found = []
    for rule, items in wrong.items():
        fqn, module, why = items[0]
        more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
        found.append(
            Diagnostic(
                SL202,
                f"{rule.style.name} does not apply to '{fqn or 'root'}' ({type(module).__name__}){more}",
                rule.style.span,
                (why,),
            )
        )
    return found


def _misfit(style: ir.Style, module: nn.Module, tp: int) -> str | None:
    """Why `style` cannot shard `module` at TP size `tp`, with what fits instead; None if it can."""
    kind = style_kind(style)
    if kind in LINEAR_STYLES and not isinstance(module, (nn.Linear, nn.Embedding)):
        return f"{kind} shards nn.Linear and nn.Embedding only; {fitting_style(module)}"
    if kind in LINEAR_STYLES and _nested_parameters(module):
        # torch's styles distribute every parameter below the module as if it were the weight, and its
        # forward would run the submodules on a shard or a partial sum (a norm on the embedding's output)
        return (
            f"its submodules hold parameters ({few(_nested_parameters(module))}): "
            f"{kind} would lay them out as its weight and run them on a split output; leave it without a rule, "
            "or `use` a style of your own"
        )
    if kind in CONV1D_STYLES:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            plain = kind.removesuffix("_conv1d")
            return f"{kind} is for a weight stored [in, out], as transformers' Conv1D stores it; {type(module).__name__} takes {plain}"
        if _nested_parameters(module) or getattr(module, "weight", None) is None or module.weight.ndim != 2:
            return f"{kind} shards a layer with a 2-D weight stored [in, out] (transformers' Conv1D); {fitting_style(module)}"
    if kind == "packed_colwise":
        if not isinstance(module, nn.Linear):
            return f"packed_colwise splits the packed output rows of an nn.Linear; {fitting_style(module)}"
        parts = style.get("parts", 2)
        rows = module.out_features
        if rows % parts or rows // parts % tp:
            return (
                f"its {rows} output rows do not split into {parts} equal parts that each divide by tp={tp}: "
                "packed_colwise needs out_features divisible by parts x tp"
            )
    if kind == "mla_kv_a_proj":
        rope = style.get("rope")
        if not isinstance(module, nn.Linear):
            return f"mla_kv_a_proj is for MLA's kv_a_proj_with_mqa, an nn.Linear; {fitting_style(module)}"
        if rope >= module.out_features:
            return f"rope={rope} leaves no latent of its {module.out_features} outputs (rope: the rotary key's width)"
    if kind == "expert_tensor_parallel":
        layout = expert_tp_layout(module, tp)
        if isinstance(layout, str):
            return layout
    if kind == "expert_parallel":
        members = expert_members(module)
        experts = stacked_experts(module) if members is None else len(members)
        if experts is None:
            below = next((name for name, m in module.named_modules() if name and stacked_experts(m)), None)
            hint = f"; its submodule '{below}' holds stacked experts: give it the rule" if below else ""
            return (
                "expert_parallel splits a module holding every expert's weights stacked on dim 0 (transformers' "
                "experts: gate_up_proj [experts, ...]; torchtitan's grouped experts: w1 [experts, ...]) or an "
                f"nn.ModuleList/ModuleDict of experts of one class; a router stays whole on every rank{hint}"
            )
        if experts % tp:
            return f"its {experts} experts do not split evenly over {tp} ranks"
    if kind in ("sequence_parallel", "replicated_with_grad_allreduce"):
        nested = _nested_parameters(module)
        if nested:
            role = "norms and dropout" if kind == "sequence_parallel" else "a module's own parameters (a q/k norm)"
            return f"{kind} is for {role}; parameters below it: {few(nested)}"
    return None


def fitting_style(module: nn.Module) -> str:
    """What fits a module that colwise/rowwise cannot shard: its submodules, the Conv1D styles, or (for
    fused 3-D expert tensors or anything else) no rule or a `use`d style."""
    own = {n: p for n, p in module.named_parameters(recurse=False)}
    if any(p.ndim == 3 for p in own.values()):
        tensors = ", ".join(f"{n} {list(p.shape)}" for n, p in own.items() if p.ndim == 3)
        return (
            f"it holds 3-D tensors ({tensors}, fused experts): `expert_parallel` splits them by expert, "
            "`expert_tensor_parallel` each expert by its width, or leave it without a rule (each tp rank keeps "
            "the experts whole and fully_shard shards them over dp)"
        )
    if own.get("weight") is not None and own["weight"].ndim == 2 and not _nested_parameters(module):
        return (
            "if it computes x @ weight + bias with its weight stored [in, out] (transformers' Conv1D), use "
            "colwise_conv1d or rowwise_conv1d; otherwise `use` a style of your own"
        )
    if _nested_parameters(module):
        return "match their submodules instead"
    if own and all(p.ndim == 1 for p in own.values()):  # a norm's scale and shift
        return (
            f"{type(module).__name__} holds only 1-D parameters (a norm's): `sequence_parallel` runs it on each "
            "rank's shard of the sequence (its weight replicated), or leave it without a rule (each tp rank runs "
            "it whole)"
        )
    return f"no built-in style shards a {type(module).__name__}: `use` a style of your own"


def _nested_parameters(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters() if "." in n]


def loss_parallel_output(
    plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes
) -> list[Diagnostic]:
    """SL207: loss_parallel needs an output layer that leaves class-sharded logits as a DTensor."""
    if plan.loss_parallel is None:
        return []
    for match in resolution.rules:
        style = match.rule.style
        if (
            style_kind(style) == "colwise"
            and style.get("output") == ir.Shard(-1)
            and style.get("local_output") is False
        ):
            return []
    return [
        Diagnostic(
            SL207,
            "loss_parallel needs an output layer with colwise(output=shard(-1), local_output=false)",
            plan.loss_parallel,
            ("the loss is computed on logits sharded over the classes; give the model's output layer that style",),
        )
    ]
