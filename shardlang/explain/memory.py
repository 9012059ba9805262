"""Live memory and op costs of one simulated training step, with torch's own trackers.

torch.distributed._tools ships `MemTracker` (any model) and `FSDPMemTracker` (an FSDP2 root): dispatch
modes that follow every storage the step allocates, by category, the way the CUDA caching allocator
sees it (an allocation lives until its storage is freed). explain runs them on fake tensors under the
fake process group. Measured with torch 2.13, they work there but for one thing, which `Extension`
mends in the smallest way we found:

- DTensor works out an op's output shapes by running it on fake copies of its global-shaped inputs
  (`ShardingPropagator._propagate_tensor_meta_non_cached`), under `detect_fake_mode()`: on a real
  GPU that is a fake mode of its own, which the trackers skip, but inside a fake step it is the step's
  own mode, so the trackers count those global-sized copies as allocations. For a fused AdamW step over
  DTensors that is four times the model's parameters, and the peak lands there (21 GiB instead of
  ~6 for the 1B model at world 2). The extension marks the span of that call and tracks nothing in it.

It adds two things the trackers do not keep: which module allocated each activation, so that the
peak can be broken down by module, and each op's FLOPs (torch.utils.flop_counter's formulas) and
bytes read and written, for the roofline in `timing`.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from copy import deepcopy
from functools import wraps

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _UpdateType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

#: The categories explain reports, from the trackers' reference types (their `.value`s).
CATEGORIES = {
    "Parameter": "parameters",
    "Sharded Param": "parameters",
    "Buffer": "parameters",
    "Unsharded Param": "gathered",
    "All Gather": "gathered",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporary",
    "Reduce Scatter": "temporary",
    "Other": "activations",  # the inputs, for MemTracker
}
ORDER = ("parameters", "gathered", "gradients", "optimizer", "activations", "temporary")

#: Ops that only name their input anew (no kernel, no bytes moved).
_FREE = frozenset({"detach", "view", "_unsafe_view", "t", "transpose", "permute", "expand", "alias", "slice", "select"})
#: Allocations that run no kernel.
_UNWRITTEN = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def _cpu_attention(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_attention_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


#: The fake step runs on CPU, where SDPA is the CPU flash kernel, which torch's FLOP formulas do not
#: list: counted as the CUDA flash kernel it stands for (torch's formulas, no causal halving).
_CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


class Extension:
    """What explain adds to a torch memory tracker (mixed in before it): see the module's docstring."""

    def _setup_extension(self) -> None:
        self._propagating = 0
        self._act_by_module: Counter[str] = Counter()
        self.peak_by_module: dict[str, int] = {}
        #: (kind, FLOPs, bytes, low precision, recomputed) -> how many ops had exactly that cost. Kinds:
        #: "kernel" (a local op: one launch), "part" (one tensor of a foreach or fused op, whose launch is
        #: its own "kernel" entry), "dtensor" (a DTensor op, dispatched on the CPU to local ops).
        self.costs: Counter[tuple[str, int, int, bool, bool]] = Counter()

    @contextlib.contextmanager
    def _skip_propagation(self):
        original = ShardingPropagator._propagate_tensor_meta_non_cached

        @wraps(original)
        def marked(propagator, *args, **kwargs):
            self._propagating += 1
            try:
                return original(propagator, *args, **kwargs)
            finally:
                self._propagating -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = marked
        try:
            yield
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = original

    def __enter__(self):
        if getattr(self, "_depth", 0) == 0:
            self._skipping = self._skip_propagation()
            self._skipping.__enter__()
            # torch 2.13's trackers note the fake mode they were entered under (to tell DTensor's
            # propagation ops from real ones); torch 2.11's do not: note it here for both.
            self._fake_mode_on_entry = active_fake_mode()
        return super().__enter__()

    def __exit__(self, *args):
        super().__exit__(*args)
        if getattr(self, "_depth", 0) == 0:
            self._skipping.__exit__(*args)

    # --- which module allocated an activation ---

    def _innermost(self) -> str:
        parents = [p for p in self._mod_tracker.parents if p != "Global"]
        if not parents:
            return ""
        name = max(parents, key=len)
        root = min(parents, key=len)
        # ModTracker names modules from the root module's class name: `Transformer.layers.0`.
        return name[len(root) + 1 :] if name != root and name.startswith(root + ".") else ("" if name == root else name)

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        if u_type == _UpdateType.ADD:
            if winfo.reftype.value == "Activation":
                winfo.owner = self._innermost()
                self._act_by_module[winfo.owner] += winfo.mem_consumed
            return
        owner = getattr(winfo, "owner", None)
        if owner is None:
            return
        if u_type == _UpdateType.DEL and winfo.reftype.value == "Activation":
            self._act_by_module[owner] -= winfo.mem_consumed
        elif u_type == _UpdateType.REF:
            if old_reftype.value == "Activation":
                self._act_by_module[owner] -= winfo.mem_consumed
            elif winfo.reftype.value == "Activation":
                self._act_by_module[owner] += winfo.mem_consumed
        elif u_type == _UpdateType.SIZE and winfo.reftype.value == "Activation":
            self._act_by_module[owner] += winfo.mem_consumed - old_mem_consumed

    def _update_peak_stats(self, peak_state) -> None:
        before = dict(self._peak_mem)
        super()._update_peak_stats(peak_state)
        if self._peak_mem != before:
            self.peak_by_module = {k: v for k, v in self._act_by_module.items() if v}

    # --- the ops ---

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._propagating:
            if any(t is DTensor for t in types):
                return NotImplemented
            return func(*args, **(kwargs or {}))
        result = super().__torch_dispatch__(func, types, args, kwargs)
        if result is NotImplemented:  # a DTensor op, on its way to its local ops
            self.costs[("dtensor", 0, 0, False, self._recomputing())] += 1
        elif active_fake_mode() is self._fake_mode_on_entry:
            self._cost(func, args, kwargs or {}, result)
        return result

    def _recomputing(self) -> bool:
        # Recomputing a checkpointed forward: an op in backward with grad mode on (the engine runs
        # backward ops with it off).
        return self._mod_tracker.is_bw and torch.is_grad_enabled()

    def _cost(self, func, args, kwargs, result) -> None:
        packet = func.overloadpacket
        namespace = str(packet).partition(".")[0]
        if namespace in _COLLECTIVE_NAMESPACES or func.is_view or packet.__name__ in _FREE:
            return
        recomputed = self._recomputing()
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        if lists:
            # A foreach or fused op (optimizers) over many tensors: one op per tensor, so that the tally
            # grows with the model block by block. It reads its lists and writes those it mutates.
            mutated = [
                a
                for i, a in enumerate(args)
                if i < len(func._schema.arguments)
                and _mutated(func._schema.arguments[i])
                and any(a is b for b in lists)
            ]
            for i in range(len(lists[0])):
                moved = sum(_nbytes(a[i]) for a in lists if i < len(a)) + sum(
                    _nbytes(a[i]) for a in mutated if i < len(a)
                )
                self.costs[("part", 0, moved, _low([a[i] for a in lists if i < len(a)]), recomputed)] += 1
            self.costs[("kernel", 0, 0, False, recomputed)] += 1
            return
        outputs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        if not outputs or packet.__name__ in _UNWRITTEN:  # metadata queries; allocations with no kernel
            return
        counter = _CPU_ATTENTION.get(packet) or flop_registry.get(packet)
        flops = int(counter(*args, **kwargs, out_val=result)) if counter is not None else 0
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        moved = sum(map(_nbytes, inputs)) + sum(map(_nbytes, outputs))
        self.costs[("kernel", flops, moved, _low(inputs), recomputed)] += 1

    # --- the result ---

    def peak(self) -> tuple[int, dict[str, int]]:
        """The peak bytes and what was live at it, by explain's categories."""
        return _by_category(self._peak_mem_snap)

    def reading(self) -> tuple[dict[str, int], dict[str, int]]:
        """What is live now and what was live at the peak since the last reading (or since the tracker
        was entered), by explain's categories; the next reading's peak starts from now (as `__enter__`
        starts the trackers' own). For a pipeline, whose microbatches are measured one phase at a time."""
        current, peak = _by_category(self._curr_mem_snap)[1], _by_category(self._peak_mem_snap)[1]
        self._peak_mem_snap = deepcopy(self._curr_mem_snap)
        self._peak_mem = {dev: snap[_TOTAL_KEY] for dev, snap in self._peak_mem_snap.items()}
        return current, peak


def _by_category(snapshots) -> tuple[int, dict[str, int]]:
    total, by_category = 0, dict.fromkeys(ORDER, 0)
    for snapshot in snapshots.values():
        total += snapshot.get(_TOTAL_KEY, 0)
        for reftype, n in snapshot.items():
            if reftype != _TOTAL_KEY:
                by_category[CATEGORIES.get(getattr(reftype, "value", reftype), "temporary")] += n
    return total, by_category


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _low(tensors) -> bool:
    """Whether an op runs at the low-precision peak: any bf16 or fp16 floating input."""
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16) for t in tensors)


def _mutated(argument) -> bool:
    info = argument.alias_info
    return info is not None and info.is_write


class FSDPTracker(Extension, FSDPMemTracker):
    def __init__(self, model, optimizer):
        FSDPMemTracker.__init__(self, model, optimizer)
        self._setup_extension()


class Tracker(Extension, MemTracker):
    def __init__(self, model, optimizer):
        MemTracker.__init__(self)
        self._setup_extension()
        self.track_external(model, optimizer)

    def track_inputs(self, inputs) -> None:
        self.track_external(*[t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)])


def tracker(model, optimizer) -> Extension:
    """FSDPMemTracker for a model whose root is an FSDP2 unit, MemTracker for any other."""
    from torch.distributed.fsdp import FSDPModule

    return FSDPTracker(model, optimizer) if isinstance(model, FSDPModule) else Tracker(model, optimizer)


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm as CUDA runs it (`_fused_rms_norm`: one kernel that saves its input and the inverse
    RMS), where the fake step on CPU would run torch's composite, which saves a float32 copy of the
    input and three intermediates: 5 times the input's bytes instead of 1. Forward: the composite
    under no_grad (same values, same ops, nothing kept); backward: the composite again, differentiated
    (the same collectives as the composite's own backward, with transient memory only)."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps, composite):
        ctx.normalized_shape, ctx.eps, ctx.composite = normalized_shape, eps, composite
        ctx.save_for_backward(x, weight)
        with torch.no_grad():
            return composite(x, normalized_shape, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_()]
            if weight is not None:
                inputs.append(weight.detach().requires_grad_(weight.requires_grad))
            y = ctx.composite(inputs[0], ctx.normalized_shape, inputs[1] if weight is not None else None, ctx.eps)
            wanted = [t for t in inputs if t.requires_grad]
            found = iter(torch.autograd.grad(y, wanted, grad))
        grads = [next(found) if t.requires_grad else None for t in inputs]
        return grads[0], None, grads[1] if weight is not None else None, None, None


@contextlib.contextmanager
def cuda_like_rms_norm():
    """`torch.nn.functional.rms_norm` as CUDA's fused kernel keeps memory, for the length of the block."""
    import torch.nn.functional as F

    composite = F.rms_norm

    @wraps(composite)
    def fused(input, normalized_shape, weight=None, eps=None):
        if not input.requires_grad and (weight is None or not weight.requires_grad):
            return composite(input, normalized_shape, weight, eps)
        return _FusedRMSNorm.apply(input, tuple(normalized_shape), weight, eps, composite)

    F.rms_norm = fused
    try:
        yield
    finally:
        F.rms_norm = composite
