"""The schema of the language: which names may stand where (styles, options, checks) and their types.

Each converter turns a syntax value into its IR type or raises `Invalid` for a value that does not fit.
The static checks read these tables; so does `shardlang apply --verify` (CHECKS, the names and
arguments of the verification checks, which the parser must know without importing torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from . import ir
from . import syntax as s
from .diagnostics import SL101, SL102, Code, did_you_mean

# --- value types ------------------------------------------------------------------------------


class Invalid(Exception):
    """A value that does not fit where it stands; becomes a diagnostic at the value's span."""

    def __init__(self, code: Code, message: str, *help: str):
        super().__init__(message)
        self.code, self.message, self.help = code, message, help


Convert = Callable[[s.Value], Any]

LAYOUTS = ("shard", "replicate", "partial")
DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}
DEVICES = ("cuda", "cpu", "auto")
INIT_MODES = ("meta", "rank0", "cpu", "auto")
STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")


def bare_word(value: s.Value) -> str | None:
    """The text of a bare name (`true`, `auto`, `replicate`); None for any other value."""
    return value.text if isinstance(value, s.Name) else None


def boolean(value: s.Value) -> bool:
    if bare_word(value) in ("true", "false"):
        return value.text == "true"
    raise Invalid(SL102, f"expected true or false, got {value}", *did_you_mean(str(value), ("true", "false")))


def integer(minimum: int | None = None) -> Convert:
    def convert(value: s.Value) -> int:
        if not isinstance(value, s.Int):
            raise Invalid(SL102, f"expected an integer, got {value}")
        if minimum is not None and value.value < minimum:
            raise Invalid(SL102, f"expected an integer of at least {minimum}, got {value}")
        return value.value

    return convert


def number(value: s.Value) -> float:
    if isinstance(value, (s.Int, s.Float)) and value.value >= 0 and math.isfinite(value.value):
        return float(value.value)
    raise Invalid(SL102, f"expected a non-negative number, got {value}")


def choice(*words: str, what: str = "value") -> Convert:
    def convert(value: s.Value) -> str:
        word = bare_word(value)
        if word in words:
            return word
        hint = did_you_mean(str(value), words) or (f"one of {', '.join(words)}",)
        code = SL101 if word is not None else SL102
        raise Invalid(code, f"unknown {what} '{value}'", *hint)

    return convert


def layout(value: s.Value) -> ir.Layout:
    """`shard(D)`, `replicate` or `partial`."""
    if isinstance(value, s.Call) and value.name.text == "shard":
        if len(value.args) != 1 or not isinstance(value.args[0], s.Int):
            raise Invalid(SL102, f"shard takes one integer dimension, e.g. shard(0), got {value}")
        return ir.Shard(value.args[0].value)
    word = bare_word(value)
    if word == "replicate":
        return ir.Replicate()
    if word == "partial":
        return ir.Partial()
    if word == "shard":
        raise Invalid(SL102, "shard needs a dimension", "write shard(0), shard(1) or shard(-1)")
    name = word or (value.name.text if isinstance(value, s.Call) else None)
    if name is not None:
        raise Invalid(
            SL101,
            f"unknown layout '{name}'",
            *(did_you_mean(name, LAYOUTS) or ("a layout is shard(D), replicate or partial",)),
        )
    raise Invalid(SL102, f"expected a layout (shard(D), replicate or partial), got {value}")


def _layout_or_skip(value: s.Value) -> ir.Layout | ir.NonTensor:
    return ir.NonTensor() if bare_word(value) == "_" else layout(value)


def layouts(value: s.Value) -> tuple[ir.Layout | ir.NonTensor, ...]:
    """One layout per positional input: a single layout or a tuple such as `(shard(1), _)`."""
    if isinstance(value, s.Tuple):
        if any(isinstance(item, s.Arg) for item in value.items):
            raise Invalid(
                SL102, "positional layouts cannot be named", "use input_kwargs/desired_kwargs for keyword inputs"
            )
        return tuple(_layout_or_skip(item) for item in value.items)
    return (_layout_or_skip(value),)


def keyword_layouts(value: s.Value) -> tuple[tuple[str, ir.Layout], ...]:
    """`(name=layout, ...)` for keyword inputs."""
    items = value.items if isinstance(value, s.Tuple) else (value,)
    if not all(isinstance(item, s.Arg) for item in items):
        raise Invalid(SL102, f"expected (name=layout, ...), got {value}")
    return tuple((item.name.text, layout(item.value)) for item in items)


def layout_or_local(value: s.Value) -> ir.Layout | ir.Local:
    return ir.Local() if bare_word(value) == "local" else layout(value)


def dtype(value: s.Value) -> ir.DType:
    word = bare_word(value)
    if word in DTYPES:
        return ir.DType(DTYPES[word])
    raise Invalid(
        SL101, f"unknown dtype '{value}'", *(did_you_mean(str(value), DTYPES) or ("one of bf16, fp16, fp32",))
    )


def reshard(value: s.Value) -> bool | int:
    if isinstance(value, s.Int):
        return integer(minimum=1)(value)
    return boolean(value)


def passthrough(value: s.Value) -> Any:
    """Keyword arguments of a `use` style: numbers, booleans, layouts, names, strings and tuples of them."""
    if isinstance(value, (s.Int, s.Float, s.Str)):
        return value.value
    if isinstance(value, s.Tuple):
        if all(isinstance(i, s.Arg) for i in value.items) and value.items:
            return tuple((i.name.text, passthrough(i.value)) for i in value.items)
        return tuple(ir.NonTensor() if bare_word(i) == "_" else passthrough(i) for i in value.items)
    word = bare_word(value)
    if word in ("true", "false"):
        return word == "true"
    if word in ("replicate", "partial") or isinstance(value, s.Call):
        return layout(value)
    return word


# --- schemas: which names may stand where, and the type of each -------------------------------

STYLES: dict[str, dict[str, Convert]] = {
    "colwise": {"input": layout, "output": layout, "local_output": boolean},
    "rowwise": {"input": layout, "output": layout, "local_output": boolean},
    "sequence_parallel": {"dim": integer(), "local_output": boolean},
    "prepare_input": {
        "input": layouts,
        "desired": layouts,
        "input_kwargs": keyword_layouts,
        "desired_kwargs": keyword_layouts,
        "local_output": boolean,
    },
    "prepare_output": {"output": layouts, "desired": layouts, "local_output": boolean},
    "distribute": {"input": layout, "output": layout_or_local},
    # transformers' styles (docs/language.md §4.2): colwise/rowwise with a layout fixed, and the layouts
    # torch's styles cannot express (shardlang.runtime.tpstyles)
    "colwise_gather_output": {"input": layout, "local_output": boolean},
    "rowwise_split_input": {"output": layout, "local_output": boolean},
    "packed_colwise": {"parts": integer(minimum=2), "input": layout},
    "replicated_with_grad_allreduce": {},
    "colwise_conv1d": {"input": layout, "output": layout, "local_output": boolean},
    "rowwise_conv1d": {"input": layout, "output": layout, "local_output": boolean},
    # a mixture of experts' stacked experts, split by expert (shardlang.runtime.experts)
    "expert_parallel": {},
    # every expert split by its intermediate width over tp, outputs summed (transformers' moe_tp_experts)
    "expert_tensor_parallel": {},
    # DeepSeek's MLA: kv_a_proj_with_mqa whole on every rank, its rotary key's gradient summed over tp
    "mla_kv_a_proj": {"rope": integer(minimum=1)},
}

MIXED_PRECISION: dict[str, Convert] = {"param": dtype, "reduce": dtype, "output": dtype, "cast_forward_inputs": boolean}

#: Options of a unit (block-wide or per `each`), by block kind. `mixed_precision` is written as a call.
UNIT_OPTIONS: dict[str, dict[str, Convert]] = {
    "fully_shard": {
        "reshard_after_forward": reshard,
        "mixed_precision": None,  # a call, converted with MIXED_PRECISION
        "offload": choice("cpu", what="offload target"),
        "strategy": choice(*STRATEGIES, what="strategy"),
    },
    "replicate": {
        "bucket_cap_mb": number,
        "find_unused_parameters": boolean,
        "gradient_as_bucket_view": boolean,
        "static_graph": boolean,
    },
}
BLOCK_OPTIONS: dict[str, Convert] = {"root": boolean}
#: Options of a `context_parallel` block.
#: context_parallel's `load_balance` names: one sequence layout each in runtime.context_layout.LAYOUTS.
LOAD_BALANCERS = ("headtail", "none")

CONTEXT_OPTIONS: dict[str, Convert] = {
    "load_balance": choice(*LOAD_BALANCERS, what="load balancing"),
    "output": choice("whole", "local", what="context_parallel output"),
}


def compile_mode(value: s.Value) -> str:
    """torch.compile's `mode`, a string (its names hold dashes)."""
    if isinstance(value, s.Str) and value.value in COMPILE_MODES:
        return value.value
    text = value.value if isinstance(value, s.Str) else str(value)
    hint = did_you_mean(text, COMPILE_MODES) or (f"one of {', '.join(repr(m) for m in COMPILE_MODES)}",)
    raise Invalid(SL102, f"unknown compile mode {value}", *hint)


#: torch.compile's modes.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: The backends a plan may name: torch's own (`inductor`, its default; `aot_eager` and `eager` compile
#: without generating kernels: for debugging, and for CPUs without a C++ compiler).
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")

#: Options of a `compile` statement: torch.compile's keyword arguments.
COMPILE_OPTIONS: dict[str, Convert] = {
    "fullgraph": boolean,
    "dynamic": boolean,
    "mode": compile_mode,
    "backend": choice(*COMPILE_BACKENDS, what="compile backend"),
}

#: Options of a `pipeline` block.
PIPELINE_OPTIONS: dict[str, Convert] = {
    "schedule": choice(*ir.SCHEDULES, what="pipeline schedule"),
    "microbatches": integer(minimum=1),
    "stages_per_rank": integer(minimum=1),
}


def _model_io_layout(value: s.Value) -> ir.Layout:
    result = layout(value)
    if isinstance(result, ir.Partial):
        raise Invalid(SL102, "a model's input or output layout is replicate or shard(D), not partial")
    return result


CHECKS: dict[str, dict[str, Convert] | None] = {
    "gradients": {
        "steps": integer(minimum=1),
        "batch": integer(minimum=1),
        "rtol": number,
        "atol": number,
        "lr": number,
        "optimizer": choice("adam", "adamw", "sgd", what="optimizer"),
        "input": _model_io_layout,
        "output": _model_io_layout,
    },
    "init": {},
    "module_states": {},
    "init_device": {},
    "placements": {},
    "comms": None,  # any collective name = expected count
}
