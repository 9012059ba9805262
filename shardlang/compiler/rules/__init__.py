"""The lint rules, one module per family. Each keeps the `Rule` protocol (common.py): (plan, resolution,
predictions, mesh shapes) -> diagnostics; `RULES` is every one, in the order `lint` runs them."""

from .activations import partial_gradients
from .common import Predictions, Rule, Shapes
from .compiles import fullgraph_over_checkpoint, fullgraph_over_context_parallel
from .coverage import unsynchronised_gradients
from .devices import mixed_device_meshes, uninitialised_on_meta
from .matches import duplicate_matches, unit_conflicts
from .meshes import context_dims, tensor_and_data_dims, unused_dims
from .pipelines import stage_count, v_schedule_over_gloo, zero_bubble_with_data_parallelism
from .shards import tied_parameters, uneven_shards, unrunnable_shards
from .styles import loss_parallel_output, style_module_types

#: Every rule, in the order lint runs them.
RULES: tuple[Rule, ...] = (
    unused_dims,
    tensor_and_data_dims,
    context_dims,
    duplicate_matches,
    unit_conflicts,
    style_module_types,
    uneven_shards,
    unrunnable_shards,
    tied_parameters,
    unsynchronised_gradients,
    loss_parallel_output,
    mixed_device_meshes,
    uninitialised_on_meta,
    partial_gradients,
    stage_count,
    zero_bubble_with_data_parallelism,
    v_schedule_over_gloo,
    fullgraph_over_checkpoint,
    fullgraph_over_context_parallel,
)

__all__ = ["RULES", "Predictions", "Rule", "Shapes"]
