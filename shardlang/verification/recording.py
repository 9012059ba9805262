"""What every module call of a model was given and made, in both directions: the recording the gradients
check's localisation compares (localise.py), one per model (the sharded one and each reference).

Each call of a module is recorded at both ends: in forward, the tensors it was given (before any hook of
its own, a style's included, touched them) and its output (after them all); in backward, the gradient it
was given (with respect to its output) and the gradient it sent back to each input along its own path.
Each record's key is `name#call role`: `in I` for the call's input I, `out` for its output. The autograd
nodes of recorded outputs are kept with their calls, so that an input made by code that is no module's
can be followed back to the calls whose outputs it was made from (`Recording.sources`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..frontend.patterns import plain_name

#: The most autograd nodes walked back from a module's input to the module outputs it was made from.
SOURCES_WALKED = 100_000
#: The autograd nodes of ops that take part of a tensor (by the start of their names).
CUTS = ("Split", "UnsafeSplit", "Unbind", "Slice", "Select", "Narrow", "Chunk", "Index")


class Recording:
    """One model's records, in forward and in backward, and what ties them together: which call returned
    which other's output unchanged (`innermost`), which calls an input was made from (`sources`)."""

    def __init__(self):
        self.flows: list[tuple[str, torch.Tensor]] = []  # forward: what each call was given, and its output
        self.grads: list[tuple[str, torch.Tensor]] = []  # backward: in the order the gradients arrived
        self.forward = True
        self.calls: Counter = Counter()
        self.running: dict[int, list[str]] = {}  # id(module) -> the keys of its calls still running
        self.made: dict[int, tuple[str, torch.Tensor]] = {}  # id(output view) -> (the call, the view)
        self.passes: dict[str, str] = {}  # a call -> the call whose output it returned unchanged
        self.producers: dict[Any, str] = {}  # the autograd node of a call's recorded output -> the call
        self.given_nodes: dict[str, Any] = {}  # an input's key -> the autograd node that made it

    def sources(self, key: str) -> list[str]:
        """The calls whose outputs the input recorded as `key` was cut from by code that is no module's: in
        the autograd graph from it back to the nearest recorded outputs, those reached through an op that
        takes part of a tensor (a `chunk`, `split`, `unbind`, slice or index: CUTS), in flow order. An
        output that reaches the input only through whole-tensor ops (a residual sum) is not one."""
        seen, found, stack = set(), set(), [(self.given_nodes.get(key), False)]
        while stack and len(seen) < SOURCES_WALKED:
            node, cut = stack.pop()
            if node is None or (node, cut) in seen:
                continue
            seen.add((node, cut))
            if node in self.producers:
                if cut:
                    found.add(self.producers[node])
                continue
            cut = cut or node.name().startswith(CUTS)
            stack += [(next_, cut) for next_, _ in node.next_functions]
        return [call for call in dict.fromkeys(self.producers.values()) if call in found]

    def innermost(self, call: str) -> str:
        """The innermost call whose output `call` returned unchanged (a model's root returning its output
        layer's), or `call` itself."""
        while call in self.passes:
            call = self.passes[call]
        return call

    def flow(self, key: str, tensor: torch.Tensor, replace: bool = True) -> torch.Tensor:
        """Record `tensor` under `key` and return it as a new identity view whose gradient is recorded as it
        passes: the view is what flows on, so its gradient is this path's alone (a tensor that feeds two
        modules gets two views) and arrives before any hook downstream of it changes it. Where it cannot
        replace the tensor (`replace` false), the gradient is recorded at the tensor itself."""
        tapped = tensor.view_as(tensor) if replace else tensor
        if self.forward:
            self.flows.append((key, tensor.detach()))
            if tensor.grad_fn is not None:
                call, _, role = key.partition(" ")
                if role == "out":
                    self.producers[tapped.grad_fn] = call
                else:
                    self.given_nodes[key] = tensor.grad_fn
            if tapped.requires_grad:
                tapped.register_hook(lambda grad: self.grads.append((key, grad.detach())))
        return tapped


def record(model, step) -> Recording:
    """Run `step(model, stop)` with hooks at both ends of every module call (see the module's docstring);
    `stop()` ends the forward phase (a recomputation under activation checkpointing is not recorded, but
    takes the same views, so that it replays the same operations)."""
    recording = Recording()
    handles = []
    for name, module in model.named_modules():
        name = plain_name(name)
        # First of its pre-hooks (before a style's or FSDP's change the inputs), last of its hooks.
        handles.append(module.register_forward_pre_hook(_given(recording, name), prepend=True, with_kwargs=True))
        handles.append(module.register_forward_hook(_made(recording)))
    try:
        step(model, lambda: setattr(recording, "forward", False))
    finally:
        for handle in handles:
            handle.remove()
    return recording


def _given(recording: Recording, name: str):
    """The pre-hook: each floating-point tensor the call was given (positional or keyword) is recorded."""

    def hook(module, args, kwargs):
        key = name
        if recording.forward:
            recording.calls[name] += 1
            key = f"{name}#{recording.calls[name]}"
        recording.running.setdefault(id(module), []).append(key)
        slots = [*enumerate(args), *kwargs.items()]
        floats = [(slot, v) for slot, v in slots if isinstance(v, torch.Tensor) and v.is_floating_point()]
        if not floats:
            return None
        args, kwargs = list(args), dict(kwargs)
        for slot, value in floats:
            tapped = recording.flow(f"{key} in {slot}", value)
            if isinstance(slot, int):
                args[slot] = tapped
            else:
                kwargs[slot] = tapped
        return tuple(args), kwargs

    return hook


def _made(recording: Recording):
    """The forward hook: the call's output (its first floating-point tensor) is recorded."""

    def hook(module, args, output):
        key = recording.running[id(module)].pop()
        tensor = _first_tensor(output)
        if tensor is None:
            return None
        if recording.forward and id(tensor) in recording.made:
            recording.passes[key] = recording.made[id(tensor)][0]
        if output is tensor:
            tapped = recording.flow(f"{key} out", tensor)
            recording.made[id(tapped)] = (key, tapped)  # kept alive with it: ids are not reused meanwhile
            return tapped
        if type(output) in (tuple, list) and any(item is tensor for item in output):
            tapped = recording.flow(f"{key} out", tensor)
            recording.made[id(tapped)] = (key, tapped)
            return type(output)(tapped if item is tensor else item for item in output)
        recording.flow(f"{key} out", tensor, replace=False)  # a dict, a ModelOutput, a nested tensor
        return None

    return hook


def _first_tensor(value) -> torch.Tensor | None:
    """The first floating-point tensor of a module's output (a tensor, a tuple, a dict or a ModelOutput,
    which transformers registers with torch's pytree)."""
    return next((t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
