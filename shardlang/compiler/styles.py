"""DSL styles -> torch ParallelStyle constructors: plain data naming the torch callable and its arguments.

A style lowers to a `Constructor`: a torch callable by import path and its keyword arguments (plain
values, placements as `ir` layouts). runtime.values reads it two ways, as the objects apply runs and
as the Python that `compile --emit python` prints, so the two cannot disagree.
"""

from __future__ import annotations

from typing import Any

from attrs import frozen

from ..frontend import ir

TP = "torch.distributed.tensor.parallel"
#: shardlang's own ParallelStyles (runtime.tpstyles), for layouts torch's styles cannot express.
OURS = "shardlang.runtime.tpstyles"


@frozen
class Constructor:
    """`path(**kwargs)`: a torch (or user) callable by import path, and its keyword arguments."""

    path: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        return self.path.replace(":", ".").rsplit(".", 1)[-1]


@frozen
class Reference:
    """A function or class by import path, passed as it is (not called): FSDP's `shard_placement_fn`."""

    path: str

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]


@frozen
class Defaults:
    """What a tensor-parallel style takes as its input and gives as its output where its rule says neither."""

    input: Any
    output: Any


#: torch's own defaults (ColwiseParallel's, RowwiseParallel's, SequenceParallel's): written here once, for lint
#: (rules.activations) and lint's step (explain.rehearsal) to read; runtime.tpstyles' Conv1D and packed styles
#: take them from torch's classes, and tests/test_styles holds both to torch's.
DEFAULT_LAYOUTS = {
    "colwise": Defaults(input=ir.Replicate(), output=ir.Shard(-1)),
    "rowwise": Defaults(input=ir.Shard(-1), output=ir.Replicate()),
    "sequence_parallel": Defaults(input=ir.Shard(1), output=ir.Shard(1)),
}
#: What each of those styles takes as its input where its rule gives no `input=`.
DEFAULT_INPUTS = {name: defaults.input for name, defaults in DEFAULT_LAYOUTS.items()}


#: Built-in styles that are torch's colwise or rowwise with one layout fixed: transformers' names for them.
FIXED_LAYOUTS = {
    "colwise_gather_output": ("colwise", "output", ir.Replicate()),
    "rowwise_split_input": ("rowwise", "input", ir.Replicate()),
}


def expand(style: ir.Style) -> ir.Style:
    """A style with a fixed layout written as the torch style it is: `colwise_gather_output(input=shard(1))`
    is `colwise(input=shard(1), output=replicate)`. Any other style is returned as it is."""
    if style.use is not None or style.name not in FIXED_LAYOUTS:
        return style
    base, arg, layout = FIXED_LAYOUTS[style.name]
    return ir.Style(base, (*style.kwargs, (arg, layout)), style.span)


def _placement(layout: Any) -> Any:
    """`_` (a non-tensor input) is None in torch's input layouts."""
    return None if isinstance(layout, ir.NonTensor) else layout


def _layouts(value: tuple) -> Any:
    """One layout stays a single placement; several become a tuple, as PrepareModuleInput takes them."""
    items = tuple(_placement(v) for v in value)
    return items[0] if len(items) == 1 else items


def constructor(style: ir.Style) -> Constructor:
    """The torch constructor for a built-in style, or the user's for a `use` style (ParallelStyle subclass)."""
    if style.use is not None:
        return Constructor(style.use.path, tuple((k, _passthrough(v)) for k, v in style.kwargs))
    style = expand(style)
    get = style.get
    if style.name in ("colwise", "rowwise", "colwise_conv1d", "rowwise_conv1d"):
        cls = {
            "colwise": f"{TP}.ColwiseParallel",
            "rowwise": f"{TP}.RowwiseParallel",
            "colwise_conv1d": f"{OURS}.ColwiseConv1DParallel",
            "rowwise_conv1d": f"{OURS}.RowwiseConv1DParallel",
        }[style.name]
        kwargs = {
            "input_layouts": get("input"),
            "output_layouts": get("output"),
            "use_local_output": get("local_output"),
        }
        return Constructor(cls, _given(kwargs))
    if style.name == "packed_colwise":
        return Constructor(
            f"{OURS}.PackedColwiseParallel", _given({"parts": get("parts"), "input_layouts": get("input")})
        )
    if style.name == "replicated_with_grad_allreduce":
        return Constructor(f"{OURS}.ReplicatedWithGradAllReduce")
    if style.name == "mla_kv_a_proj":
        return Constructor(f"{OURS}.MlaKvAProjParallel", (("rope", get("rope")),))
    if style.name == "expert_tensor_parallel":
        return Constructor("shardlang.runtime.experts.ExpertTensorParallel")
    if style.name == "expert_parallel":
        return Constructor("shardlang.runtime.experts.ExpertParallel", _given({"shared_batch": get("shared_batch")}))
    if style.name == "sequence_parallel":
        return Constructor(
            f"{TP}.SequenceParallel", _given({"sequence_dim": get("dim"), "use_local_output": get("local_output")})
        )
    if style.name == "prepare_input":
        kwargs = {
            "input_layouts": _layouts(get("input")) if get("input") is not None else None,
            "desired_input_layouts": _layouts(get("desired")) if get("desired") is not None else None,
            "input_kwarg_layouts": dict(get("input_kwargs")) if get("input_kwargs") is not None else None,
            "desired_input_kwarg_layouts": dict(get("desired_kwargs")) if get("desired_kwargs") is not None else None,
            "use_local_output": get("local_output"),
        }
        return Constructor(f"{TP}.PrepareModuleInput", _given(kwargs))
    if style.name == "prepare_output":
        kwargs = {
            "output_layouts": _layouts(get("output")) if get("output") is not None else None,
            "desired_output_layouts": _layouts(get("desired")) if get("desired") is not None else None,
            "use_local_output": get("local_output"),
        }
        return Constructor(f"{TP}.PrepareModuleOutput", _given(kwargs))
    raise ValueError(f"style {style.name} is not a ParallelStyle")  # distribute lowers to distribute_module


def _given(kwargs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple((k, v) for k, v in kwargs.items() if v is not None)


def _passthrough(value: Any) -> Any:
    """User style arguments: `(a, b)` stays a tuple, `(x=shard(0))` becomes a dict, `_` becomes None."""
    if (
        isinstance(value, tuple)
        and value
        and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) for v in value)
    ):
        return {k: _passthrough(v) for k, v in value}
    if isinstance(value, tuple):
        return tuple(_passthrough(v) for v in value)
    return _placement(value)
