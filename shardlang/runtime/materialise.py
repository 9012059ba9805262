"""`init meta`'s materialisation: the shards allocated on the mesh device, the buffers the constructor computed
put back, and the calls compiler.initialisers lists made with one seed on every rank, each seeing its tensors
as an unsharded model would have them (whole on a CPU mesh), and what each call wrote read from the
parameters' version counters (a per-module METHOD is then called below). Pasted into printed programs with
the helpers it calls (runtime.steps)."""

from __future__ import annotations

import contextlib

from ..compiler.initialisers import calls_below, initialisation_calls, is_hugging_face
from .gathering import fill_shard, shards_on_cpu, whole


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

    allocate_on(model, device)
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    hugging_face = is_hugging_face(model)
    with torch.random.fork_rng(devices=devices), torch.no_grad(), untied_for_init(model):
        torch.manual_seed(seed)
        for module, init, subtree in initialisation_calls(model, method):
            written = run_initialiser(module, init, subtree, device, hugging_face)
            if subtree:
                initialise_below(model, module, method, written, device, hugging_face)


def allocate_on(model, device):
    """Allocate every tensor of a meta model on `device` (`to_empty`), then put back the buffers its
    constructor computed, which building on meta kept real (rotary tables, causal masks, position ids)."""
    import torch
    from torch.distributed.tensor import DTensor

    computed = {n: b for n, b in model.named_buffers() if not b.is_meta and not isinstance(b, DTensor)}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in computed.items():
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = buffer.to(device)


def initialise_below(model, module, method, written, device, hugging_face):
    """After `method` on `module` wrote `written` (ids) of its subtree's parameters: the method on each module
    below that defines it and still holds parameters nobody wrote, asked after each call (`calls_below`)."""
    left = {id(p) for p in module.parameters()} - written

    def unwritten(below):
        return any(id(p) in left for p in below.parameters())

    for below, call, _ in calls_below(model, module, method, unwritten):
        left.difference_update(run_initialiser(below, call, True, device, hugging_face))


def run_initialiser(module, init, subtree, device, hugging_face):
    """Make one initialisation call on `module`; the ids of the parameters it wrote (in place, which their
    version counters tell, or by replacing them). A subtree call reaches every tensor below its module.
    transformers' _init_weights(module) may set the tensors of the module's children too (GPT-2 rescales
    `c_proj.weight` from its attention and MLP modules). Other per-module initialisers set their module's
    own tensors."""
    owners = list(module.modules() if subtree else [module, *(module.children() if hugging_face else ())])
    written = on_shards(owners, init, device)
    if written is not None:
        return written
    return on_whole_tensors(module, owners, init, subtree, device)


def on_shards(owners, init, device):
    """The call made on the shards themselves, on CUDA, where DTensor's RNG initialises each shard: the ids
    it wrote, or None where it must run on whole tensors instead, as on the CPU. That is where torch cannot
    run the initialiser on the shards (torch 2.11 fails on some indexing of strided shards), and where a
    shard is already on the CPU (`to_empty` let FSDP pin an offloading unit's shards): the RNG would follow
    the GPU's offsets and draw from the CPU's generator, the same values on every rank."""
    import torch

    if torch.device(device).type == "cpu" or shards_on_cpu(owners):
        return None
    before = parameter_versions(owners, {})
    try:
        init()
    except (RuntimeError, ValueError, NotImplementedError):
        return None
    return written_since(before)


def on_whole_tensors(module, owners, init, subtree, device):
    """The call made with every DTensor of `owners` whole, as in an unsharded model; each rank then keeps
    its slice (`put_back`). The ids of the parameters it wrote."""
    entries, originals = made_whole(module, owners, subtree, device)
    before = parameter_versions(owners, originals)
    try:
        init()
        return written_since(before)
    finally:
        put_back(entries)


def put_back(entries):
    """Put each DTensor of `entries` (made_whole's) back in its place, its shard filled from the whole
    tensor that stood there, as the call left it or replaced it (a buffer recomputed, a weight re-tied)."""
    from torch.distributed.tensor import DTensor

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
    made, entries, originals = {}, [], {}
    for owner, store, name, tensor in dtensors_of(owners):
        if id(tensor) not in made:  # a tied tensor is made whole once, and stays tied
            keep = subtree or owner is not module
            made[id(tensor)] = whole_for_call(tensor, keep, store is owner._parameters, device)
            originals[id(made[id(tensor)])] = tensor
        entries.append((store, name, tensor))
        store[name] = made[id(tensor)]
    return entries, originals


def dtensors_of(owners):
    """(owner, store, name, tensor) for each DTensor parameter and buffer of `owners`, read as it is reached:
    a generator, so that one made whole before is seen as it now is."""
    from torch.distributed.tensor import DTensor

    for owner in owners:
        for store in (owner._parameters, owner._buffers):
            for name, tensor in store.items():
                if isinstance(tensor, DTensor):
                    yield owner, store, name, tensor


def whole_for_call(tensor, keep_values, parameter, device):
    """A whole tensor to stand for DTensor `tensor` during a call: with its current values where the call
    may read or leave them (`keep_values`: a subtree, a child), new memory where the module's own
    initialiser sets them all; a Parameter where `tensor` is one (`parameter`)."""
    import torch

    value = whole(tensor) if keep_values else torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    return torch.nn.Parameter(value, tensor.requires_grad) if parameter else value


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
