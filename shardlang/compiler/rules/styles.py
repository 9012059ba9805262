"""Styles that do not fit (SL202, SL207): a style on the wrong module type, loss_parallel without its output layer."""

from __future__ import annotations

from collections import defaultdict

import torch.nn as nn

from ...frontend import ir
from ...frontend.diagnostics import SL202, SL207, Diagnostic, few
from ..predict import style_kind


def style_module_types(plan, resolution, predictions, shapes) -> list[Diagnostic]:
    """SL202: colwise/rowwise on anything but Linear and Embedding; sequence_parallel on a container.
    One diagnostic per rule."""
    wrong: dict[ir.Rule, list] = defaultdict(list)
    for match in resolution.rules:
        module = resolution.modules[match.fqn]
        kind = style_kind(match.rule.style)
        if kind in ("colwise", "rowwise") and not isinstance(module, (nn.Linear, nn.Embedding)):
            wrong[match.rule].append(
                (match.fqn, module, f"{kind} shards nn.Linear and nn.Embedding only; match their submodules instead")
            )
        elif kind == "sequence_parallel":
            nested = [n for n, p in module.named_parameters() if "." in n]
            if nested:
                why = f"sequence_parallel is for norms and dropout; parameters below it: {few(nested)}"
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


def loss_parallel_output(plan, resolution, predictions, shapes) -> list[Diagnostic]:
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
