"""Plain-torch helpers that a lowered program calls where torch has no one-line API.

apply calls these functions, and `compile --emit python` copies their source into the program it
prints, so the pasted code and `shardlang apply` run the same lines. Each helper imports what it
needs and calls only torch and the other pasted functions (these, frontend.patterns and
compiler.devices), which the printed program defines beside it.
"""

from __future__ import annotations

import contextlib

from ..compiler.devices import mesh_device
from ..compiler.initialisers import calls_below, initialisation_calls, is_hugging_face
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


def init_on_mesh(model, device, method, seed):
    """Materialise a model whose parameters were built on the meta device and sharded: allocate every
    local shard on `device`, put back the buffers the constructor computed, then make the calls
    `initialisation_calls` lists, with the same seed on every rank: without `method`, the model's own
    initialiser on every module (children first), each setting its module's own tensors; with `method`,
    that method once on each outermost module that defines it, setting its whole subtree, and where that call
    left parameters below it unwritten (a method that sets its module's own parameters only, as torchtitan's
    `_init_self_parameters`), the method in turn on each module below that defines it and holds such
    parameters, parents before children (`calls_below`). A transformers model's tied tensors are initialised
    once, as their tie's source (`untied_for_init`).

    On CUDA, DTensor's random number generator gives each shard its own values, and a call runs on the
    shards. On the CPU it would repeat the same values in every shard, so there (and on CUDA where torch
    cannot run the call on the shards, or where FSDP keeps them on the CPU) every sharded tensor the call
    sets is made whole for the call, as in an unsharded model, and each rank then keeps its slice. A
    tensor the call replaces (a buffer recomputed, a weight re-tied) is sliced from its new value.
    """
    import torch
    from torch.distributed.tensor import DTensor

    computed = {n: b for n, b in model.named_buffers() if not b.is_meta and not isinstance(b, DTensor)}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in computed.items():
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = buffer.to(device)
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    hugging_face = is_hugging_face(model)
    with torch.random.fork_rng(devices=devices), torch.no_grad(), untied_for_init(model):
        torch.manual_seed(seed)
        for module, init, subtree in initialisation_calls(model, method):
            written = run_initialiser(module, init, subtree, device, hugging_face)
            if not subtree:
                continue
            left = {id(p) for p in module.parameters()} - written

            def unwritten(below, left=left):
                return any(id(p) in left for p in below.parameters())

            for below, call, _ in calls_below(model, module, method, unwritten):
                left -= run_initialiser(below, call, True, device, hugging_face)


def run_initialiser(module, init, subtree, device, hugging_face):
    """Make one initialisation call on `module`; the ids of the parameters it wrote (in place, which their
    version counters tell, or by replacing them). A subtree call reaches every tensor below its module.
    transformers' _init_weights(module) may set the tensors of the module's children too (GPT-2 rescales
    `c_proj.weight` from its attention and MLP modules). Other per-module initialisers set their module's
    own tensors."""
    import torch
    from torch.distributed.tensor import DTensor

    owners = list(module.modules() if subtree else [module, *(module.children() if hugging_face else ())])
    # On CUDA DTensor's RNG initialises each shard itself. It runs in full as on the CPU where torch
    # cannot run an initialiser on the shards (torch 2.11 fails on some indexing of strided shards),
    # and where a shard is already on the CPU (`to_empty` let FSDP pin an offloading unit's shards):
    # the RNG would follow the GPU's offsets and draw from the CPU's generator, the same values on
    # every rank.
    try:
        if torch.device(device).type != "cpu" and not shards_on_cpu(owners):
            before = parameter_versions(owners, {})
            init()
            return written_since(before)
    except (RuntimeError, ValueError, NotImplementedError):
        pass
    entries, originals = made_whole(module, owners, subtree, device)
    before = parameter_versions(owners, originals)
    try:
        init()
        return written_since(before)
    finally:
        filled = set()
        for store, name, tensor in entries:
            now = store[name]
            store[name] = tensor
            if id(tensor) not in filled and now is not None:
                filled.add(id(tensor))
                fill_shard(tensor, whole(now) if isinstance(now, DTensor) else now)


def made_whole(module, owners, subtree, device):
    """Put a whole tensor in place of each DTensor of `owners` for a call on the CPU: (entries, originals),
    entries (store, name, DTensor) to put back, originals the DTensor behind each whole tensor's id."""
    import torch
    from torch.distributed.tensor import DTensor

    made, entries, originals = {}, [], {}
    for owner in owners:
        for store in (owner._parameters, owner._buffers):
            for name, tensor in store.items():
                if not isinstance(tensor, DTensor):
                    continue
                if id(tensor) not in made:  # a tied tensor is made whole once, and stays tied
                    # Whole with its current values where the call may read or leave them (a subtree,
                    # a child); new memory where the module's own initialiser sets them all.
                    value = (
                        whole(tensor)
                        if subtree or owner is not module
                        else torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                    )
                    if store is owner._parameters:
                        value = torch.nn.Parameter(value, tensor.requires_grad)
                    made[id(tensor)] = value
                    originals[id(value)] = tensor
                entries.append((store, name, tensor))
                store[name] = made[id(tensor)]
    return entries, originals


def parameter_versions(owners, originals):
    """What a call may write among `owners`' parameters: (store, name, tensor there now, its version, the
    parameter it stands for: the DTensor in `originals`, else itself)."""
    return [
        (owner._parameters, name, tensor, versions(tensor), originals.get(id(tensor), tensor))
        for owner in owners
        for name, tensor in owner._parameters.items()
        if tensor is not None
    ]


def versions(tensor):
    """A tensor's version counter, and a DTensor's shard's too: a call that writes `to_local()` moves only
    the shard's."""
    local = getattr(tensor, "_local_tensor", None)
    return tensor._version, None if local is None else local._version


def written_since(before):
    """The ids of the parameters of `before` (parameter_versions) that were written in place since, or replaced."""
    return {
        id(original)
        for store, name, tensor, version, original in before
        if store.get(name) is not tensor or versions(tensor) != version
    }


@contextlib.contextmanager
def untied_for_init(model):
    """transformers initialises a tied tensor once, as its tie's source: a model ties its weights after
    initialising them (post_init's tie_weights), so what the tie's target was initialised with (ModernBERT's
    decoder, of a smaller std than its token embedding) went to a tensor the tie then dropped. While the
    calls run, each target of `all_tied_weights_keys` that is tied holds a tensor of its own, dropped after;
    the tie is made again. Other models' ties are left as they are."""
    import torch

    ties = []
    keys = (getattr(model, "all_tied_weights_keys", None) or {}) if is_hugging_face(model) else {}
    for target, source in keys.items():
        owner, _, leaf = target.rpartition(".")
        try:
            tied, kept = model.get_parameter(target), model.get_parameter(source)
        except AttributeError:
            continue
        if tied is kept:
            module = model.get_submodule(owner)
            module._parameters[leaf] = torch.nn.Parameter(torch.empty_like(kept), kept.requires_grad)
            ties.append((module, leaf, kept))
    try:
        yield
    finally:
        for module, leaf, kept in ties:
            module._parameters[leaf] = kept


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
