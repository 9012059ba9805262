"""Plain-torch helpers that a lowered program calls where torch has no one-line API.

apply calls these functions, and `compile --emit python` copies their source into the program it
prints, so the pasted code and `shardlang apply` run the same lines. Each helper imports what it
needs and calls only torch and the other pasted functions (these, frontend.patterns and
compiler.devices), which the printed program defines beside it.
"""

from __future__ import annotations

import contextlib

from ..compiler.devices import mesh_device
from ..frontend.patterns import depth, modules_matching, named_units_win


def wrap_children_first(model, units):
    """Apply each (target, kind, wrap) to the modules its target matches, deepest modules first, so that
    a fully_shard or replicate unit is always wrapped before any unit that contains it. A tuple of targets
    is one unit over every module they match (`unit a, b`): `wrap` gets the list, when it is wrapped
    after the units inside its shallowest module."""
    order = {fqn: i for i, (fqn, _) in enumerate(model.named_modules())}
    matches = []
    for target, kind, wrap in units:
        if isinstance(target, tuple):
            fqns = tuple(sorted({fqn for t in target for fqn in modules_matching(model, t)}, key=order.__getitem__))
            matches += [(fqns, kind, False, wrap)] if fqns else []
        else:
            matches += [(fqn, kind, target.startswith("class "), wrap) for fqn in modules_matching(model, target)]

    def children_first(match):
        fqns = match[0] if isinstance(match[0], tuple) else (match[0],)
        return -min(map(depth, fqns)), order[fqns[0]]

    for fqns, _, _, wrap in sorted(named_units_win(matches), key=children_first):
        if isinstance(fqns, tuple):
            wrap([model.get_submodule(fqn) for fqn in fqns])
        else:
            wrap(model.get_submodule(fqns))


def tied_parameter_groups(model):
    """Names of parameters that share one Parameter object, one tuple per shared parameter."""
    names = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None:
                full = f"{module_name}.{name}" if module_name else name
                names.setdefault(id(param), [])
                if full not in names[id(param)]:
                    names[id(param)].append(full)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def build_for(init, device, build_model):
    """Build the model where `init` says: meta, cpu, rank 0's cpu (meta elsewhere), or the mesh device."""
    import torch
    import torch.distributed as dist

    if init == "rank0":
        init = "cpu" if dist.get_rank() == 0 else "meta"
    if init == "auto":
        init = mesh_device(device)
        if init == "cuda":
            init = torch.device("cuda", torch.cuda.current_device())
    if init == "meta":
        with parameters_on_meta():
            return build_model()
    with torch.device(init):
        return build_model()


@contextlib.contextmanager
def parameters_on_meta():
    """Parameters created while this is active go to the meta device as they are registered (before the
    module's constructor initialises them, so that costs nothing); buffers stay real, on the CPU, with
    the values the constructor computed (rotary tables, causal masks, position ids)."""
    import torch.nn as nn

    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def submesh(mesh, dims):
    """Some dims of a mesh: the mesh itself, one dim, or several (for FSDP's 2-D HSDP mesh)."""
    if tuple(dims) == tuple(mesh.mesh_dim_names):
        return mesh
    return mesh[dims[0]] if len(dims) == 1 else mesh[tuple(dims)]


def divide_gradients(unit, factor: int, mesh) -> None:
    """An FSDP unit over `mesh` whose gradients are reduced as a sum divided by `factor` instead of the mesh's
    size (experts that borrow data-parallel ranks: frontend.desugar). gloo has no PreMulSum: there the sum
    is reduced and divided after. A unit over one rank reduces nothing, and FSDP2 divides its copy of the
    gradient by the factor and then again by the post-division that a summed (or fp16) reduction sets, so
    there the unit keeps FSDP's own (no) division and a hook after its reduction divides once (dp of size
    1: every data rank is an ep rank). `unit`: what fully_shard returned (a list of modules for a unit over
    several, which share one state: any of them sets it)."""
    import torch.distributed as dist

    unit = unit[0] if isinstance(unit, list) else unit
    if mesh.size() == 1:
        unit.set_all_reduce_hook(lambda reduced: reduced.div_(float(factor)))
        return
    unit.set_gradient_divide_factor(float(factor))
    if dist.get_backend(mesh.get_group()) == "gloo":
        unit.set_force_sum_reduction_for_comms(True)


def mesh_of(mesh, dims, flat: bool = False):
    """The mesh a plan's mesh ref names: some dims of `mesh`, or (`flat`, `world[dp*ep]`) those dims flattened
    into one, named by joining theirs with `_`."""
    return flat_mesh(mesh, dims) if flat else submesh(mesh, dims)


def flat_mesh(mesh, dims):
    """A 1-D mesh over the given dims (DDP-style replicate takes only 1-D meshes)."""
    sub = submesh(mesh, dims)
    return sub if sub.ndim == 1 else sub._flatten("_".join(dims))


def distribute_with_layouts(module, mesh, input_placement, output_placement):
    """distribute_module (parameters and buffers replicated over `mesh`) where each tensor input becomes
    `DTensor.from_local(x, mesh, [input_placement])` and the output goes back to a local tensor
    (`output_placement` None) or is redistributed to `output_placement`."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_module

    def input_fn(mod, inputs, device_mesh):
        return tuple(
            DTensor.from_local(x, device_mesh, [input_placement], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def output_fn(mod, outputs, device_mesh):
        if output_placement is None:
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs
        return outputs.redistribute(device_mesh, [output_placement])

    return distribute_module(module, mesh, input_fn=input_fn, output_fn=output_fn)


def apply_user_style(module, mesh, style, **kwargs):
    """A user style: a ParallelStyle subclass (instantiated with kwargs) or a callable (module, mesh, **kwargs)."""
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

    if isinstance(style, type) and issubclass(style, ParallelStyle):
        return parallelize_module(module, mesh, style(**kwargs))
    return style(module, mesh, **kwargs)


def retie(model, groups):
    """Make each group of parameter names share one Parameter again, preferring one that was distributed
    (parallelize_module replaces the parameters it shards, which unties them)."""
    from torch.distributed.tensor import DTensor

    for names in groups:
        params = [model.get_parameter(name) for name in names]
        shared = next((p for p in params if isinstance(p, DTensor)), params[0])
        for name in names:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)


def common_seed():
    """One random seed, the same on every rank: rank 0's, broadcast."""
    import torch
    import torch.distributed as dist

    seed = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.int64)
    if dist.is_initialized():
        backend = str(dist.get_backend())
        seed = seed.to("cuda" if "nccl" in backend and "gloo" not in backend else "cpu")
        dist.broadcast(seed, src=0)
    return int(seed.item())


def whole(tensor):
    """A DTensor's whole value, on its mesh's device: `full_tensor()`, for a shard kept off that device too (a
    unit's `offload = cpu` on GPUs), and gathered by hand where torch cannot plan the redistribution (torch
    2.11: FSDP's Shard(1) over the _StridedShard(0) of a packed weight)."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local().detach()
    if local.device.type != tensor.device_mesh.device_type:  # from_local puts the shard on the mesh's device
        tensor = DTensor.from_local(
            local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
    try:
        return tensor.full_tensor()
    except ValueError:  # torch could not plan it (a failing collective raises RuntimeError, and stays raised)
        return gather_by_hand(tensor)


def gather_by_hand(tensor):
    """`tensor.full_tensor()` for any placements but Partial: every rank learns where its shard's elements sit
    in the whole tensor (the placements applied to their positions, without communication), then shards and
    positions are gathered along each mesh dim in turn."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    mesh, local = tensor.device_mesh, tensor.to_local().detach()
    positions = torch.arange(tensor.numel(), device=local.device).view(tensor.shape)
    where = distribute_tensor(positions, mesh, tensor.placements, src_data_rank=None).to_local()
    pieces = [(where.reshape(-1).cpu(), local.reshape(-1).cpu())]
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, pieces, group=group)
        pieces = [piece for theirs in everyone for piece in theirs]
    result = torch.empty(tensor.numel(), dtype=tensor.dtype)
    for at, values in pieces:
        result[at] = values
    return result.view(tensor.shape).to(local.device)


def fill_shard(tensor, full):
    """Copy this rank's slice of `full` (DTensor `tensor`'s whole value, the same on every rank) into its shard,
    wherever the shard is."""
    from torch.distributed.tensor import distribute_tensor

    shard = distribute_tensor(full.detach(), tensor.device_mesh, tensor.placements, src_data_rank=None)
    tensor.to_local().copy_(shard.to_local())


def shards_on_cpu(modules) -> bool:
    """Whether any of `modules`' own DTensors holds its shard on the CPU."""
    return any(
        shard_on_cpu(tensor)
        for module in modules
        for store in (module._parameters, module._buffers)
        for tensor in store.values()
    )


def shard_on_cpu(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor) and tensor.to_local().device.type == "cpu"


def rank0_values(model):
    """Rank 0's side of `init rank0`, before sharding: every parameter's and buffer's value by name (each
    name of a tied tensor), kept on the CPU; the model then moves to the meta device like the other ranks'.
    Keyed by `named_parameters()`/`named_buffers()`, not `state_dict()`: a model's state-dict hooks may
    rename or split its tensors (a fused QKV saved as wq/wk/wv), and the shards are filled by name.
    `model.to` would untie tensors shared by several modules (each module's copy moved on its own): the
    other ranks built theirs tied, and FSDP would then shard another list of parameters on rank 0."""
    import torch

    values = {}
    shared = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is not None:
                    full = f"{module_name}.{name}" if module_name else name
                    values[full] = tensor.detach()
                    shared.setdefault(id(tensor), []).append(full)
    model.to("meta")
    for names in shared.values():
        first, *others = names
        owner, _, leaf = first.rpartition(".")
        module = model.get_submodule(owner)
        tensor = module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]
        for other in others:
            owner, _, leaf = other.rpartition(".")
            store = model.get_submodule(owner)
            (store._parameters if leaf in store._parameters else store._buffers)[leaf] = tensor
    return {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in values.items()}


def load_from_rank0(model, device, full_state):
    """Materialise a sharded meta model from rank 0's values (`rank0_values`; empty elsewhere): allocate the
    shards on `device`, then broadcast each parameter and buffer whole from rank 0 and copy its shard."""
    import torch

    on_gpus = torch.device(device).type != "cpu"
    # model.to_empty(device=device), except that the shards of an offloading unit that rank 0 built stay in
    # pinned CPU memory, where FSDP put them: torch refuses to move a DTensor's storage to another device in place.
    model._apply(lambda t: t if on_gpus and shard_on_cpu(t) else torch.empty_like(t, device=device))
    scatter_from_rank0(model, device, full_state)


def scatter_from_rank0(model, device, full_state):
    """Load rank 0's `full_state` ({name: whole tensor} for every parameter and buffer name; empty elsewhere)
    into the model's tensors, sharded or not, wherever their shards are (FSDP pins an offloading unit's in CPU
    memory): each tensor is broadcast whole on `device` (in the model's dtype), then every rank copies its
    shard. Every name and shape is checked on rank 0 first, and every rank raises the same ValueError before
    anything is copied if one does not fit."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    seen, tensors = set(), []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors.append((name, tensor))
    problems = []
    if dist.get_rank() == 0:
        for name, tensor in tensors:
            have = full_state.get(name)
            if not isinstance(have, torch.Tensor):
                problems.append(f"{name}: not among rank 0's tensors")
            elif tuple(have.shape) != tuple(tensor.shape):
                problems.append(f"{name}: {tuple(have.shape)} on rank 0, {tuple(tensor.shape)} sharded")
    verdict = [problems]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise ValueError("rank 0's model does not fit the sharded one: " + "; ".join(verdict[0][:5]))
    with torch.no_grad():
        for name, tensor in tensors:
            if dist.get_rank() == 0:
                full = full_state[name].detach().to(device=device, dtype=tensor.dtype)
            else:
                full = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            dist.broadcast(full, src=0)
            if isinstance(tensor, DTensor):
                fill_shard(tensor, full)
            else:
                tensor.copy_(full)


def sync_module_states(model, mesh, dims):
    """Broadcast every parameter and buffer from the first rank of its group along each of `dims`,
    skipping a dim along which the tensor is sharded (each rank rightly holds its own piece)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    tensors = [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]
    with torch.no_grad():
        for dim in dims:
            group = mesh.get_group(dim)
            src = dist.get_global_rank(group, 0)
            for tensor in tensors:
                if isinstance(tensor, DTensor):
                    names = tensor.device_mesh.mesh_dim_names or ()
                    if dim in names and not isinstance(tensor.placements[names.index(dim)], Replicate):
                        continue
                    tensor = tensor.to_local()
                dist.broadcast(tensor, src=src, group=group)


def offload_to_cpu(unit):
    """Move the parameters fully_shard unit `unit` manages (its subtree's, less those of units nested in it)
    to the CPU, where its `offload = cpu` policy wants them before the first forward (FSDP pins them there
    where its policy says so). Tied parameters stay tied."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    def managed(module):
        yield module
        for child in module.children():
            if not isinstance(child, FSDPModule):
                yield from managed(child)

    moved = {}
    for module in managed(unit):
        for param in module._parameters.values():
            if param is None or id(param) in moved:
                continue
            # FSDP may already have moved a pinned unit's shards to the CPU (when the model was materialised), its
            # DTensors still saying they are on the GPU: FSDP checks what they say.
            local = param.to_local() if isinstance(param, DTensor) else param
            if param.device.type == "cpu" and local.device.type == "cpu":
                continue
            if isinstance(param, DTensor):
                # Made as fully_shard makes its sharded parameters, around the shard where it is (DTensor.from_local
                # would put it back on the mesh's device).
                copy = DTensor(local.detach().cpu(), param._spec, requires_grad=param.requires_grad)
            else:
                copy = param.detach().cpu()
            moved[id(param)] = torch.nn.Parameter(copy, requires_grad=param.requires_grad)
    for module in unit.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) in moved:
                module._parameters[name] = moved[id(param)]


def move_to_device(model, device):
    """Move parameters and buffers that no sharding moved (plain tensors) to `device`."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for module in model.modules():
            for param in module._parameters.values():
                if param is not None and not isinstance(param, DTensor) and param.device != torch.device(device):
                    param.data = param.data.to(device)
            for name, buffer in module._buffers.items():
                if buffer is not None and not isinstance(buffer, DTensor) and buffer.device != torch.device(device):
                    module._buffers[name] = buffer.to(device)


def compiled_loss(loss, **options):
    """`loss` compiled as the plan's `compile loss (OPTIONS)` says (torch.compile's own keywords), once per
    function and options: the same compiled function every step."""
    import torch

    key = (loss, tuple(sorted(options.items())))
    cache = compiled_loss.__dict__.setdefault("cache", {})
    if key not in cache:
        cache[key] = torch.compile(loss, **options)
    return cache[key]


def unit_of(module):
    """What fully_shard takes for `module`: the module itself, or, for a ModuleList or ModuleDict with a
    forward of its own (experts held as modules, after expert_parallel), the list of its members: one unit
    over them all. torch 2.11's fully_shard refuses any container, forward or not; later torches take it."""
    import torch.nn as nn

    container = isinstance(module, (nn.ModuleList, nn.ModuleDict))
    if container and ("forward" in vars(module) or type(module).forward is not nn.Module.forward):
        return list(module.children())
    return module
