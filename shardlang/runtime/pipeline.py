"""Pipeline stages cut from a whole model, and the schedule that trains them: plain torch, pasted into the
program `compile --emit python` prints, as the helpers runtime.steps names are.

A stage is the whole model with the modules of other stages replaced by pass-throughs (docs/language.md
§4.5). It runs the model's own forward, so whatever the model computes outside its blocks (rotary
tables, masks, position ids) is computed on every stage as the model would. The first block it holds
takes the activation the previous stage sent in place of its input, and the output of the last block it
holds is what it sends. The model's inputs reach every stage as the keyword argument `shardlang_inputs`
(torch's schedules hand keyword arguments to every stage), so only activations travel between ranks.
"""

from __future__ import annotations

import torch


class PassThrough(torch.nn.Module):
    """A module another stage holds. As a block (or a module after the stack) it returns the activation it
    is given; before the stack it returns the activation this stage received, so that shapes and dtypes
    computed from it are right, or, where the module's own output has another shape (DeepSeek V4 widens
    its embedding into hyper-connection streams before the stack), zeros of that shape in the received
    dtype: what the model computes from them before the stack is thrown away, since the stage's first
    block takes the received activation. `twin`: the module itself with its tensors on the meta device,
    kept out of the module tree (nothing to shard or train), for that shape and for the attributes the
    model reads of it (`self.lm_head.weight.dtype`; a submodule it reaches through it is a pass-through
    too)."""

    #: What a stage is told where the model breaks the contract (lint's step points these at the pipeline):
    #: its last block returns more than the running activation, or a module declared after the stack runs
    #: before it, or one declared before it runs after it (OPT's final_layer_norm).
    ONE_ACTIVATION = "a pipeline stage sends one tensor, the output of its last block"
    RUNS_EARLY = "a pipeline stage cannot run a module another stage holds"

    def __init__(self, role, carry, twin=None, name=""):
        super().__init__()
        self.role, self.carry, self.name = role, carry, name
        self.__dict__["twin"] = twin

    def forward(self, *args, **kwargs):
        if self.role == "after" and not self.carry.get("blocks"):  # blocks_begin: the stage's first block
            raise TypeError(
                f"{self.RUNS_EARLY}: '{self.name}' runs before the blocks, but the model declares it after them, so the "
                "last stage holds it (with no traced order, or where the trace did not run it, the order of "
                "declaration places a module); give the model file an example_input, or declare it before the stack"
            )
        if self.role == "before" and self.carry.get("blocks"):
            raise TypeError(
                f"{self.RUNS_EARLY}: '{self.name}' runs after the blocks, but the model declares it before them, so the "
                "first stage holds it (with no traced order, or where the trace did not run it, the order of "
                "declaration places a module); give the model file an example_input, or declare it after the stack"
            )
        if self.role == "before":
            received = self.carry["received"]
            shape = self.own_shape(args, kwargs)
            if shape is None or shape == tuple(received.shape):
                return received
            return torch.zeros(shape, dtype=received.dtype, device=received.device)
        given = args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))
        wrapped = self.wrapped(args, kwargs) if self.role == "block" else None
        return given if wrapped is None else wrapped[0]([given] + [None] * (wrapped[1] - 1))

    def wrapped(self, args, kwargs):
        """How the block wraps its activation, learnt once from its twin on the meta device: (tuple or list,
        length) where it returns the activation in a tuple or list whose other items are None (TAPAS's
        `(hidden_states,)`, RWKV's `(hidden_states, None, None)`), so that the model unwraps a pass-through's
        as it does its own blocks'; None where it returns it alone."""
        if "wrap" not in self.__dict__:
            self.__dict__["wrap"] = wrapping(self._on_meta(args, kwargs))
        return self.__dict__["wrap"]

    def _on_meta(self, args, kwargs):
        """The twin's output on these inputs on the meta device, outside any dispatch mode (explain's fake
        step, its trackers); None where there is no twin or it will not run."""
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils._pytree import tree_map

        twin = self.__dict__["twin"]
        if twin is None:
            return None

        def on_meta(x):
            return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x

        try:
            with _disable_current_modes(), torch.no_grad():
                return twin(*tree_map(on_meta, args), **tree_map(on_meta, kwargs))
        except Exception:  # noqa: BLE001 - as if it returned the activation alone
            return None

    def own_shape(self, args, kwargs):
        """The shape of the module's own output on these inputs (_on_meta); None where it is no one tensor or
        will not run."""
        out = self._on_meta(args, kwargs)
        return tuple(out.shape) if isinstance(out, torch.Tensor) else None

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            twin = self.__dict__.get("twin")
            if twin is None or name.startswith("_"):
                raise
            found = getattr(twin, name)  # a submodule of a module another stage holds: held there too
            if isinstance(found, torch.nn.Module):
                return PassThrough(self.role, self.carry, found, f"{self.name}.{name}")
            return found

    def extra_repr(self):
        return f"{self.role} (held by another pipeline stage)"


def blocks_begin(carry):
    """The first block a stage holds has begun: a module after the stack may run from here on."""

    def hook(module, args, kwargs):
        carry["blocks"] = True

    return hook


#: The contract's breaches, as the errors begin (explain.rehearsal and init point them at the pipeline).
CONTRACT = (PassThrough.ONE_ACTIVATION, PassThrough.RUNS_EARLY)


def meta_twin(module):
    """A copy of `module` whose parameters and buffers are on the meta device (no memory, no values)."""
    import copy
    import itertools

    memo = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        twin = torch.empty_like(t, device="meta")
        memo[id(t)] = torch.nn.Parameter(twin, t.requires_grad) if isinstance(t, torch.nn.Parameter) else twin
    return copy.deepcopy(module, memo)


def split_stages(model, blocks, dropped, stages):
    """This rank's stages of `model`, {stage: module}: for each stage index in `stages`, the model (for the
    first; deep copies for the others) with the modules `dropped[stage]` lists replaced by pass-throughs.
    `blocks[s]` are the FQNs of stage s's blocks, in order."""
    import copy

    copies = [model] + [copy.deepcopy(model) for _ in stages[1:]]
    last = len(blocks) - 1
    parts = {}
    for part, stage in zip(copies, stages):
        carry = {}
        for fqn, role in dropped[stage]:
            part.set_submodule(fqn, PassThrough(role, carry, meta_twin(part.get_submodule(fqn)), fqn))
        part.get_submodule(blocks[stage][0]).register_forward_pre_hook(blocks_begin(carry), with_kwargs=True)
        if stage > 0:
            part.get_submodule(blocks[stage][0]).register_forward_pre_hook(take_received(carry), with_kwargs=True)
        if stage < last:
            part.get_submodule(blocks[stage][-1]).register_forward_hook(keep_sent(carry))
        part.register_forward_pre_hook(stage_inputs(carry, stage > 0), with_kwargs=True, prepend=True)
        part.register_forward_hook(stage_output(carry, stage == last), prepend=True)
        part.shardlang_carry = carry
        part.shardlang_sends = stage < last  # its output is an activation for the next stage, not the model's
        parts[stage] = part
    return parts


def stage_inputs(carry, receives):
    """The stage's forward takes the received activation (not the first stage) and the model's inputs as
    `shardlang_inputs`; the model's forward is called with the model's inputs."""

    def hook(module, args, kwargs):
        kwargs = dict(kwargs)
        carry["blocks"] = False  # no block has run yet in this forward
        inputs = kwargs.pop("shardlang_inputs", None)
        if inputs is None:
            raise RuntimeError("a pipeline stage runs through its schedule (Pipeline.step), not called directly")
        if receives:
            received = args[0] if len(args) == 1 else args
            received.shardlang_received = True  # a recomputation (activation checkpointing) sees it again
            carry["received"] = received
            args = tuple(inputs)
        return args, kwargs

    return hook


def take_received(carry):
    def hook(module, args, kwargs):
        given = args[0] if args else kwargs.get("hidden_states")
        if getattr(given, "shardlang_received", False):
            return None  # already the received activation (or a recomputation of this microbatch)
        if args:
            return (carry["received"], *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": carry["received"]}
        raise RuntimeError("the stage's first block takes no activation as its first argument")

    return hook


def wrapping(output):
    """(tuple or list, length) where `output` is a tuple or list holding the activation first and None
    after it; else None."""
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        if all(x is None for x in output[1:]):
            return type(output), len(output)
    return None


def keep_sent(carry):
    def hook(module, args, output):
        if wrapping(output) is not None:  # (hidden_states,): the activation, wrapped
            output = output[0]
        if not isinstance(output, torch.Tensor):
            parts = output if isinstance(output, (tuple, list)) else (output,)
            kinds = ", ".join(
                str(x.dtype).removeprefix("torch.") + " tensor" if isinstance(x, torch.Tensor) else type(x).__name__
                for x in parts
            )
            raise TypeError(
                f"{PassThrough.ONE_ACTIVATION}, but the blocks return a {type(output).__name__} ({kinds}), whose other parts "
                "the model may hand the next block: each block must return the running activation alone (or first in a "
                "tuple or list whose other items are None)"
            )
        carry["sent"] = output

    return hook


def stage_output(carry, last):
    """What the stage returns: the last block's output, or (the last stage) the model's output as a tuple of
    tensors, its structure kept in `carry` for the loss."""
    from torch.utils._pytree import tree_flatten

    def hook(module, args, output):
        if not last:
            return carry.pop("sent")
        leaves, spec = tree_flatten(output)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        carry["structure"] = (spec, [None if isinstance(x, torch.Tensor) else x for x in leaves])
        return tensors[0] if len(tensors) == 1 else tuple(tensors)

    return hook


def model_output(carry, output):
    """The last stage's output in the model's own structure (a tensor, a tuple, a Hugging Face output)."""
    from torch.utils._pytree import tree_unflatten

    spec, leaves = carry["structure"]
    tensors = iter(output if isinstance(output, (tuple, list)) else (output,))
    return tree_unflatten([next(tensors) if x is None else x for x in leaves], spec)


class Pipeline:
    """This rank's stages and the schedule that trains them. `step(*inputs)` runs one training step's
    forward and backward on the whole batch, split into microbatches; on the ranks of the last stage it
    returns the loss (the mean of the microbatches' losses, whose gradients the schedule averages), else None.

    `loss(output, inputs)` is the model file's loss: `inputs` is the microbatch's input tensor (or tuple)."""

    def __init__(self, parts, num_stages, schedule, microbatches, pp_group, device, loss, scale_grads=True):
        self.parts, self.inputs, self.microbatches = parts, None, microbatches
        self._made = (num_stages, schedule, pp_group, device, loss, scale_grads)
        self._shapes = None  # the input shapes the stages were made for
        self._make()

    def _make(self) -> None:
        """The stages and their schedule. torch's stages learn their microbatches' shapes at their first
        step and keep them: a step on another batch (apply's comms check runs two microbatches' worth, its
        gradients check its own batch) needs new ones, or the last stage's loss meets a stale shape."""
        from torch.distributed import pipelining

        num_stages, schedule, pp_group, device, loss, scale_grads = self._made
        self.stages = [
            pipelining.PipelineStage(part, stage, num_stages, device, group=pp_group)
            for stage, part in self.parts.items()
        ]
        self.last = self.stages[-1] if self.stages[-1].is_last else None
        carry = self.parts[max(self.parts)].shardlang_carry

        def stage_loss(output, target):
            # The microbatch's inputs: the schedule splits `target` as it splits the inputs; several inputs
            # are taken by their rows.
            if len(self.inputs) == 1:
                return loss(model_output(carry, output), target)
            inputs = tuple(x[target] if isinstance(x, torch.Tensor) else x for x in self.inputs)
            return loss(model_output(carry, output), inputs)

        kind = getattr(pipelining, schedule)
        stages = self.stages[0] if len(self.stages) == 1 else self.stages
        self.schedule = kind(stages, self.microbatches, loss_fn=stage_loss, scale_grads=scale_grads)

    def step(self, *inputs):
        shapes = tuple(tuple(x.shape) for x in inputs if isinstance(x, torch.Tensor))
        if self._shapes is not None and shapes != self._shapes:
            self._make()
        self._shapes = shapes
        self.inputs = inputs
        batch = next(x for x in inputs if isinstance(x, torch.Tensor))
        target = inputs[0] if len(inputs) == 1 else torch.arange(batch.shape[0], device=batch.device)
        losses = []
        # Positional inputs go to the first stage only (torch 2.11's shape inference refuses them elsewhere);
        # every stage gets them as `shardlang_inputs`.
        first = inputs if any(stage.is_first for stage in self.stages) else ()
        self.schedule.step(*first, target=target, losses=losses, shardlang_inputs=inputs)
        self.inputs = None
        if not losses:
            return None
        return torch.stack([x.detach().float() for x in losses]).mean()


def holds(model, fqn):
    """Whether `model` (a stage) holds module `fqn`: it exists and no module on its path is a pass-through."""
    module = model
    for name in fqn.split(".") if fqn else ():
        module = getattr(module, name, None)
        if module is None or isinstance(module, PassThrough):
            return False
    return True


def held_plan(model, plan):
    """The entries of a parallelize_module plan ({relative FQN: style}) whose modules the stage holds."""
    return {fqn: style for fqn, style in plan.items() if holds(model, fqn)}


def stages_view(parts, held):
    """One module tree holding every stage of `parts` ({stage: module}) under the model's own names, for
    what reads a rank's parameters and buffers by name (the checks, checkpoints). `held[s]` are the
    FQNs of the modules stage s holds. The modules are the stages' own (no tensor is copied); the tree
    above them is a shallow copy without hooks. Training goes through the Pipeline, not this view."""
    if len(parts) == 1:
        return next(iter(parts.values()))
    from collections import OrderedDict

    def clone(module):
        twin = object.__new__(type(module))
        twin.__dict__ = dict(module.__dict__)
        twin._modules = dict(module._modules)
        for name in module.__dict__:
            if name.endswith("_hooks") or name.endswith("_hooks_with_kwargs") or name.endswith("_always_called"):
                twin.__dict__[name] = OrderedDict()
        return twin

    stages = sorted(parts)
    view = clone(parts[stages[0]])
    cloned = {id(view)}
    for stage in stages:
        for fqn in held[stage]:
            *path, name = fqn.split(".")
            parent = view
            for step in path:
                child = parent._modules[step]
                if id(child) not in cloned:
                    child = clone(child)
                    cloned.add(id(child))
                    parent._modules[step] = child
                parent = child
            parent._modules[name] = parts[stage].get_submodule(fqn)
    return view
