"""Tied parameters: which names share one Parameter, and the ties made again after sharding undid them.
Pasted into printed programs (runtime.steps names which): each function imports what it needs and
calls only torch and the other pasted functions."""

from __future__ import annotations


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
