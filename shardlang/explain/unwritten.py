"""Which parameters `init meta` would leave unwritten (SL224): the initialisers run on a copy of the meta
model made of fake CPU tensors, which hold no memory, and the parameters whose version counters no call
moved. Not meta tensors: torch's initialisers return at once on those (trunc_normal_ moves no version
counter there), while they run through on fake ones. A call that fake tensors cannot run through (one that
reads a value: torchtitan's rotary tables, torch's trunc_normal_ resampling until its values fit) is taken
to write every parameter of its module's subtree: SL224 is an error, and it names only what is certainly
left unwritten. (No stand-ins here, unlike lint's step: a loop until values fit would never end on ones.)
Lint's step and `shardlang init` ask it."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..compiler.initialisers import calls_below, initialisation_calls
from ..runtime.materialise import allocate_on


def left_unwritten(model: nn.Module, method: str | None) -> list[str] | None:
    """The parameters of `model`, built on the meta device, that `init meta` (with `method`, None for the
    model's own way) leaves holding whatever memory held: no call `initialisation_calls` lists (nor
    `calls_below` after a METHOD) writes them. None when the model is not on meta, or cannot be copied and
    allocated as fake tensors (could not tell)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..runtime.ties import retie, tied_parameter_groups
    from .fakestep import quiet

    if not any(p.is_meta for p in model.parameters()):
        return None
    try:
        model = copy.deepcopy(model)  # of meta tensors (a fake mode cannot copy them)
        with quiet("torch._subclasses.fake_tensor"), FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            groups = tied_parameter_groups(model)
            allocate_on(model, "cpu")  # fake CPU tensors, the buffers the constructor computed kept
            retie(model, groups)  # to_empty gave each alias of a tied weight its own tensor
            return _unwritten(model, method)
    except Exception:  # noqa: BLE001 - a model that cannot be copied or allocated: "could not tell"
        return None


def _unwritten(model: nn.Module, method: str | None) -> list[str]:
    named = dict(model.named_parameters())
    before = {name: p._version for name, p in named.items()}
    prefixes = {id(m): name for name, m in model.named_modules()}

    assumed: set[int] = set()  # written by a call that raised: its subtree's parameters

    def unwritten(module: nn.Module) -> bool:
        prefix = prefixes[id(module)]
        return any(
            p._version == before.get(n) and id(p) not in assumed for n, p in module.named_parameters(prefix=prefix)
        )

    def attempt(module: nn.Module, call) -> None:
        try:
            call()
        except Exception:  # noqa: BLE001 - the model's own code, on fake tensors
            assumed.update(id(p) for p in module.parameters())

    for module, call, subtree in initialisation_calls(model, method):
        attempt(module, call)
        for below, call_below, _ in calls_below(model, module, method, unwritten) if subtree else ():
            attempt(below, call_below)
    return [name for name, p in named.items() if p._version == before[name] and id(p) not in assumed]
