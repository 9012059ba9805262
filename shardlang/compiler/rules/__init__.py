"""The lint rules (SL201-SL217, SL301), one module per family; each rule is (plan, resolution, predictions, mesh shapes) -> diagnostics."""

from .activations import partial_gradients
from .coverage import unsynchronised_gradients
from .devices import mixed_device_meshes, uninitialised_on_meta
from .matches import duplicate_matches, unit_conflicts
from .meshes import unused_dims
from .pipelines import stage_count, v_schedule_over_gloo, zero_bubble_with_data_parallelism
from .shards import tied_parameters, uneven_shards, unrunnable_shards
from .styles import loss_parallel_output, style_module_types

#: Every rule, in the order lint runs them.
RULES = (
    unused_dims,
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
)
