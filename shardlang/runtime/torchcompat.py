"""What differs between the torch versions shardlang supports (2.11 and newer), in one place.

Private torch paths are imported here only, each with the public one first where one exists.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator


def fsdp_strided_shard() -> bool:
    """Whether FSDP2 marks its shard of a tensor that TP already shards on the same dim as `_StridedShard`
    (`(_StridedShard(dim=0, sf=tp), Shard(0))` for a colwise weight) rather than `(Shard(0), Shard(0))`.
    Seen on 2.11 and 2.13 (tests/test_apply.py::test_spec_placements_for_tp_and_fsdp); releases without
    `_StridedShard` used plain Shard."""
    from torch.distributed.tensor import placement_types

    return hasattr(placement_types, "_StridedShard")


def fake_fsdp_casts_one_rank_units() -> bool:
    """Whether, under fake tensors, FSDP2 casts to `mixed_precision`'s param dtype the parameters of a unit
    over one rank (a dp dim of size 1 beside TP) or beside tensor parallelism, as it does on real tensors.
    torch 2.11 does not: lint's step met float32 weights with bf16 inputs there, where apply's real run casts
    and passes (plans/llama_2d.sl at world 2, 2026-11-28, and at world 4, dp 2 x tp 2, 2026-12-07; a 1-D
    unit casts). 2.13 does; 2.12 is not tried and counted with 2.11."""
    import torch

    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def composable_checkpoint():
    """Non-reentrant activation checkpointing that keeps module FQNs (no public path exists)."""
    from torch.distributed._composable import checkpoint

    return checkpoint


def composable_replicate():
    """DDP-style `replicate(module, device_mesh=...)` (no public path exists)."""
    from torch.distributed._composable import replicate

    return replicate


def strided_shard_class():
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


def composable_state_mapping():
    """torch's module -> composable-API state map (fully_shard, replicate, checkpoint), or None if absent."""
    try:
        from torch.distributed import _composable_state
    except ImportError:
        return None
    return getattr(_composable_state, "_module_state_mapping", None)


def local_shape_and_offset(global_shape, mesh_shape, coordinate, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Torch's own arithmetic for the local shape and global offset of the shard at `coordinate`
    (uneven shards, empty shards and _StridedShard included); for any rank, without a process group."""
    from torch.distributed.tensor import _utils

    return _utils._compute_local_shape_and_global_offset(
        list(global_shape), list(mesh_shape), list(coordinate), placements
    )


def schedule_order(
    class_name: str, pp: int, microbatches: int, stages_per_rank: int
) -> list[list[tuple[int, str, int]]]:
    """The compute actions each pp rank of a multi-stage schedule runs, in order, from the schedule's own
    `pipeline_order` (which `_PipelineScheduleRuntime` executes): per rank a list of (stage, kind,
    microbatch), kind one of F (forward), B (full backward), I (backward for inputs) and W (backward for
    weights); an action that overlaps a forward and a backward (DualPipeV) is its parts, in order.
    torch builds the tables for its visualiser from mock stages (`get_schedule_ops`, 2.11 and 2.13)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    def parts(action) -> list[tuple[int, str, int]]:
        if action is None:
            return []
        if getattr(action, "sub_actions", None):
            return [x for sub in action.sub_actions for x in parts(sub)]
        kind = action.computation_type.value
        return [(action.stage_index, kind, action.microbatch_index)] if kind in ("F", "B", "I", "W") else []

    table = get_schedule_ops(class_name.removeprefix("Schedule"), pp, microbatches, stages_per_rank)
    return [[x for action in row for x in parts(action)] for row in table]


def hf_storage_writer(path: str, fqn_to_index: dict[str, int]):
    """DCP's Hugging Face safetensors writer, each rank writing its own shards and rank 0 joining them into
    whole tensors when the save finishes (`save_distributed`, `enable_consolidation`: torch 2.9 and newer).
    File K of N is `model-0000K-of-0000N.safetensors`, with `model.safetensors.index.json`."""
    import inspect

    import torch
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    wanted = {"save_distributed", "enable_consolidation"}
    if not wanted <= set(inspect.signature(HuggingFaceStorageWriter).parameters):
        raise RuntimeError(f"torch {torch.__version__}'s HuggingFaceStorageWriter cannot consolidate shards")
    return HuggingFaceStorageWriter(
        path, fqn_to_index_mapping=fqn_to_index, save_distributed=True, enable_consolidation=True
    )


def fsdp_param_groups(model) -> list:
    """The FSDP2 parameter groups of a model's fully_shard units (each with `fsdp_params`, FSDPParam
    objects that know their unit's offload policy: `offload_to_cpu`); torch keeps them in private state
    (`_get_fsdp_state()._fsdp_param_group`, 2.11 and 2.13, as torch's own FSDPMemTracker reads them)."""
    from torch.distributed.fsdp import FSDPModule

    groups, seen = [], set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                groups.append(group)
    return groups


def fsdp_group_forward_hooks(state, pre_hook, post_hook):
    """Forward hooks on every module of an FSDP2 unit over several modules, as fully_shard registers them
    (private `_register_group_forward_hooks`: the pre-hook on each, the post-hook's full work once the
    last has run; torch 2.13 adds the output cast to its arguments). One handle removes them all."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks

    args = [state._modules, pre_hook, post_hook, state._modules_to_run_forward]
    if len(inspect.signature(_register_group_forward_hooks).parameters) > 4:
        args.append(state._cast_output_dtype)
    return _register_group_forward_hooks(*args)


@contextlib.contextmanager
def fsdp_param_groups_hidden(states) -> Iterator[None]:
    """FSDP2 states without their parameter group for the block (code that walks FSDP modules then passes
    over them): torch 2.13 keeps the groups in a list, `_fsdp_param_groups`, older releases in one
    attribute, `_fsdp_param_group` (a property over the list in 2.13)."""
    saved = []
    for state in states:
        name = "_fsdp_param_groups" if "_fsdp_param_groups" in vars(state) else "_fsdp_param_group"
        saved.append((state, name, vars(state)[name]))
        setattr(state, name, [] if name == "_fsdp_param_groups" else None)
    try:
        yield
    finally:
        for state, name, value in saved:
            setattr(state, name, value)


def fsdp_param_class():
    """FSDP2's per-parameter class and its sharded-state enum (private; the same module in 2.11 and 2.13)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState

    return FSDPParam, ShardedState


def all_to_all_autograd(tensor, output_sizes: list[int], input_sizes: list[int], group):
    """`all_to_all_single` that autograd runs backwards (the gradient goes back the way the rows came);
    torch.distributed.nn.functional's is deprecated in favour of the functional collectives' one."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_to_all_single_autograd(tensor, output_sizes, input_sizes, group))


def is_fake(tensor) -> bool:
    """Whether `tensor` has no data: a fake tensor (explain's and lint's simulated step) or one on meta."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return tensor.device.type == "meta" or fake(tensor)


def clear_sharding_caches() -> None:
    """Forget DTensor's sharding propagation caches (Python's and the C++ fast path's): their entries hold
    the meshes, and so the process groups, of the world they were filled in."""
    from torch.distributed.tensor import debug

    clear = getattr(debug, "_clear_sharding_prop_cache", None) or debug._clear_python_sharding_prop_cache
    clear()
