"""What every simulated training step shares, whole-model or one pipeline stage at a time: fake tensors
that note each collective, AdamW as it stands after warm-up, process groups named by mesh dim, tokens."""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from attrs import frozen


@frozen
class Collective:
    """One kind of collective on one mesh dim over a training step: how often, and how many bytes its
    full buffers hold in all (the gathered or reduced tensor; what NCCL calls the message size)."""

    op: str
    mesh_dim: str
    count: int
    bytes: int


@frozen
class Peak:
    """The most memory rank R holds at once over the simulated step (forward, loss, backward, optimizer
    step), as torch's memory trackers see it: `bytes`, and what is live then by category and, for
    activations, by the module that allocated them (the largest, at most `TOP_MODULES`)."""

    bytes: int
    categories: tuple[tuple[str, int], ...]
    modules: tuple[tuple[str, int], ...]
    batch: int  # the per-replica batch handed to example_input
    tokens: int  # per replica and step: batch x sequence (the first input's first two dims)
    replicas: int  # data-parallel replicas, each with its own batch
    #: What units that offload to the CPU (`offload = cpu`) keep in host memory instead, at its most over
    #: the step: their sharded parameters, gradients and optimizer states (0 and () without offload).
    #: `bytes` and `categories` are then the accelerator's alone.
    host: int = 0
    host_categories: tuple[tuple[str, int], ...] = ()

    def category(self, name: str) -> int:
        return dict(self.categories).get(name, 0)


def recording_fake_mode(recorder):
    """A FakeTensorMode (non-fake inputs allowed) that also notes each collective on `recorder` (a
    verification.comms.Calls): one dispatch mode instead of two."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    plain = (FakeTensor, torch.Tensor, nn.Parameter)  # the types FakeTensorMode runs itself

    class RecordingFakeMode(FakeTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t not in plain for t in types):
                # A DTensor op: let DTensor desugar it into local ops and collectives, which come back
                # here. FakeTensorMode would say the same, but only after missing its cache (22,000
                # such misses in the 80-layer step).
                return NotImplemented
            recorder.note(func, args)
            return super().__torch_dispatch__(func, types, args, kwargs)

    return RecordingFakeMode(allow_non_fake_inputs=True)


def warm_adamw(model: nn.Module) -> torch.optim.Optimizer:
    """Fused AdamW over the model's trained parameters, as it stands in the step after warm-up, as a
    training loop runs it: its states exist (the first step created them at its optimizer step), the
    gradients do not (zero_grad(set_to_none=True))."""
    from torch.distributed.tensor import DTensor

    trained = [p for p in model.parameters() if p.requires_grad]
    # One group of DTensors and one of plain tensors: a fused step takes no mixture (a TP stage's norms
    # and embeddings stay plain beside its sharded Linears).
    kinds = [[p for p in trained if isinstance(p, DTensor) == sharded] for sharded in (True, False)]
    groups = [{"params": params} for params in kinds if params] if all(kinds) else trained
    try:
        optimizer = torch.optim.AdamW(groups, lr=1e-4, fused=True)
    except (RuntimeError, ValueError):  # a dtype or device fused AdamW does not take
        optimizer = torch.optim.AdamW(groups, lr=1e-4, foreach=False)
    for p in trained:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def by_key(calls, groups: dict[str, str]) -> dict[tuple[str, str], tuple[int, int]]:
    """Recorded collectives [(op, process group, bytes)] -> {(op, mesh dim): (count, bytes)}."""
    found: dict[tuple[str, str], tuple[int, int]] = defaultdict(lambda: (0, 0))
    for op, group, nbytes in calls:
        key = (op, groups.get(group, f"group {group}"))
        found[key] = (found[key][0] + 1, found[key][1] + nbytes)
    return dict(found)


def count_tokens(inputs: tuple, batch: int) -> int:
    """Tokens per replica and step, from the first input tensor: batch x sequence for token ids
    (integers, (batch, sequence, ...)) or embeddings ((batch, sequence, features)); else the batch."""
    first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
    if first is None or first.ndim < 2 or (first.is_floating_point() and first.ndim < 3):
        return batch
    return int(first.shape[0] * first.shape[1])


@contextlib.contextmanager
def quiet(logger: str) -> Iterator[None]:
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def idle_conversions() -> Iterator[None]:
    """`module.to(...)` that would change none of the module's tensors returns it untouched. Some models
    convert a submodule in every forward (SwitchTransformers' router: `self.classifier =
    self.classifier.to(self.dtype)`): on real tensors a no-op, on the simulated step's fake parameters a
    swap of each, which the memory tracker's references to them forbid."""
    original = nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)

        def unchanged(t: torch.Tensor) -> bool:
            converts = dtype is not None and (t.is_floating_point() or t.is_complex())
            return (device is None or t.device == torch.device(device)) and (not converts or t.dtype == dtype)

        if memory_format is None and all(unchanged(t) for t in [*self.parameters(), *self.buffers()]):
            return self
        return original(self, *args, **kwargs)

    nn.Module.to = to
    try:
        yield
    finally:
        nn.Module.to = original


def group_names(applied) -> dict[str, str]:
    """Process group name -> `mesh.dim` (several dims of a group joined by +)."""
    names = {dist.distributed_c10d._get_default_group().group_name: "world"}
    for mesh_name, mesh in applied.meshes.items():
        for dim in mesh.mesh_dim_names or ():
            names[mesh.get_group(dim).group_name] = f"{mesh_name}.{dim}"
    for block in applied.program.plan.units:  # flattened dims (`world[dp*ep]`): a group of their own
        if block.mesh.flat:
            names.setdefault(applied.mesh(block.mesh).get_group().group_name, str(block.mesh))
    return names
