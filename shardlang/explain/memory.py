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

It adds what the trackers do not keep: which module allocated each activation (the peak by module),
each phase's own peak (explain.phases), and each op's FLOPs (torch.utils.flop_counter's formulas) and
bytes read and written, for the roofline in `timing`.

CPU offload (`CPUOffloadPolicy`). On a GPU, FSDP keeps an offloading unit's sharded parameters on the
CPU (`FSDPParam` moves `_sharded_param_data` there), copies each one to the GPU before the all-gather
(`all_gather_inputs`: `.to(device, non_blocking=True)`, then the cast to the compute dtype), copies each
reduce-scattered gradient back to the CPU (`foreach_reduce`: `.to("cpu")`, after which the GPU buffer is
freed), and the optimizer, whose parameters are those CPU tensors, keeps its states and steps there.
In the simulated world the mesh is on the CPU, so FSDP's device is the CPU: both copies are no-ops and
every fake tensor says `cpu`, where the CPU stands for the accelerator. The device cannot tell them
apart, so the extension places storages by identity instead: the storages of the offloading units'
sharded parameters, of their gradients (once FSDP's post-backward has assigned them) and of their
optimizer states, and whatever an op computes from host storages only, are counted under `HOST`, a
separate device in the trackers' per-device snapshots; all else is the accelerator's. And it does the
one copy the CPU world skips that allocates on the GPU: each offloaded shard is cloned (the H2D copy,
temporary, freed after the cast as on a GPU) before it is cast and all-gathered. The gradient's D2H
staging buffer needs nothing: it is the reduce-scatter's output, on the accelerator until post-backward
hands it to the host. The copies are tallied as `h2d` and `d2h` (bytes, one launch each), and ops on
host storages as `cpu` (bytes at the host's memory bandwidth), for `timing`.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from copy import deepcopy
from functools import wraps

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _ModState, _UpdateType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ..runtime.torchcompat import (
    fsdp_group_forward_hooks,
    fsdp_param_class,
    fsdp_param_groups,
    fsdp_param_groups_hidden,
)
from .fusednorm import REPLAYING
from .phases import Phases

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

#: The device key the trackers count host-resident storages under (see the module's docstring): every
#: fake tensor of the simulated step is on `cpu`, which stands for the accelerator.
HOST = torch.device("cpu", 1)

#: Ops that only name their input anew (no kernel, no bytes moved).
_FREE = frozenset({"detach", "view", "_unsafe_view", "t", "transpose", "permute", "expand", "alias", "slice", "select"})
#: Allocations that run no kernel.
_UNWRITTEN = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def _cpu_attention(query, key, value, *args, out_val=None, **kwargs) -> int:
    return attention_flops(query.shape, key.shape, value.shape)


def _cpu_attention_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return attention_flops(query.shape, key.shape, value.shape, backward=True)


def attention_flops(query, key, value, backward: bool = False) -> int:
    """torch.utils.flop_counter's SDPA formulas (scores, then values; the backward's five products: the
    scores again, the gradients of the probabilities, the values, the queries and the keys), with
    grouped-query attention's fewer key/value heads broadcast to the query's, as the kernel does: torch
    2.11's formulas refuse such shapes, 2.13's take them and count the same."""
    batch, heads, queries, width = query
    keys, value_width = key[-2], value[-1]
    products = 3 * width + 2 * value_width if backward else width + value_width
    return 2 * batch * heads * queries * keys * products


def grouped_mm_flops(a, b, *args, out_val=None, **kwargs) -> int:
    """torch._grouped_mm (a mixture's experts in one call): every group's product. A 2-D x 3-D call splits
    a's rows among b's groups (the forward, the input's gradient), a 2-D x 2-D one the contracted dim (the
    weights' gradient); either way the groups add up to one product of the whole shapes."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out_val.numel() * a.shape[-1]


#: The ops torch's FLOP formulas do not list. The fake step runs on CPU, where SDPA is the CPU flash kernel:
#: counted as the CUDA flash kernel it stands for (torch's formulas, no causal halving). `_grouped_mm`
#: (torchtitan's and transformers' experts) counted nothing, and explain put a mixture's step at half
#: its FLOPs (torchtitan's Qwen3-MoE: 7.9 TFLOP of 15).
_NOT_LISTED = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
    torch.ops.aten._grouped_mm: grouped_mm_flops,
}
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


class Extension:
    """What explain adds to a torch memory tracker (mixed in before it): see the module's docstring."""

    def _setup_extension(self, model, optimizer, blocks=None) -> None:
        self._model, self._optimizer = model, optimizer
        self._propagating = 0
        #: Whether any unit offloads (set on entry), whether the op in dispatch runs on the host, and the
        #: kind of copy being made ("h2d"), if any.
        self._hosted = False
        self._host_op = False
        self._copying: str | None = None
        #: A compiled module's call that began while recomputing (see recomputed_calls).
        self._in_recomputed_call = False
        self._act_by_module: Counter[str] = Counter()
        self.phases = Phases(blocks, self._act_by_module)  # each phase's peak (explain.phases)
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
        outermost = getattr(self, "_depth", 0) == 0
        if outermost:
            self._skipping = self._skip_propagation()
            self._skipping.__enter__()
            # torch 2.13's trackers note the fake mode they were entered under (to tell DTensor's
            # propagation ops from real ones); torch 2.11's do not: note it here for both.
            self._fake_mode_on_entry = active_fake_mode()
        entered = super().__enter__()
        if outermost:
            # After the trackers have registered the parameters, gradients and states (and FSDPMemTracker
            # has wrapped each unit's post-backward, which this wraps again).
            self._offloading = self._offloaded()
            self._offloading.__enter__()
        return entered

    def __exit__(self, *args):
        if getattr(self, "_depth", 0) == 1:
            self._offloading.__exit__(*args)  # before FSDPMemTracker puts back the methods it wrapped
        super().__exit__(*args)
        if getattr(self, "_depth", 0) == 0:
            self._skipping.__exit__(*args)

    # --- CPU offload: what lives on the host, and the copies (see the module's docstring) ---

    @contextlib.contextmanager
    def _offloaded(self):
        groups = [g for g in fsdp_param_groups(self._model) if any(p.offload_to_cpu for p in g.fsdp_params)]
        if not groups:
            yield
            return
        self._hosted = True
        params = [p.sharded_param for g in groups for p in g.fsdp_params if p.offload_to_cpu]
        states = self._optimizer.state if self._optimizer is not None else {}
        for param in params:
            self._to_host(param, param.grad, *tree_flatten(states.get(param, {}))[0])
        self._restart_peaks(self.get_tracker_snapshot())  # the trackers took the peak so far before the move
        with self._staged_h2d(), self._gradients_to_host(groups):
            yield

    def _to_host(self, *tensors) -> None:
        """Count the tracked storages of `tensors` as the host's from now on."""
        moved = False
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            for storage in get_untyped_storages(t):
                winfo, _ = self._WINFO.get(storage, (None, None))
                if winfo is None or winfo.device == HOST:
                    continue
                if winfo.mem_consumed > 0:
                    self._update_snap(_UpdateType.DEL, winfo)
                winfo.device = HOST
                if winfo.mem_consumed > 0:
                    self._update_snap(_UpdateType.ADD, winfo)
                moved = True
        if moved:
            self._update_peak_stats(_ModState.PEAK_BW)

    def _on_host(self, args, kwargs) -> bool:
        """Whether an op's tracked inputs all live on the host (and there is one): it runs on the CPU."""
        found = False
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                for storage in get_untyped_storages(t):
                    winfo, _ = self._WINFO.get(storage, (None, None))
                    if winfo is not None:
                        if winfo.device != HOST:
                            return False
                        found = True
        return found

    def _track(self, reftype, t) -> None:
        super()._track(reftype, t)
        if self._host_op:  # computed on the CPU from host tensors: the result is the host's too
            self._to_host(t)

    @contextlib.contextmanager
    def _staged_h2d(self):
        """FSDPParam.all_gather_inputs with the H2D copy that the CPU world skips: an offloaded shard is
        cloned (a temporary on the accelerator) and then cast, as `.to(device)` and the cast do on a GPU."""
        FSDPParam, ShardedState = fsdp_param_class()
        original = FSDPParam.__dict__["all_gather_inputs"]

        def all_gather_inputs(param):
            if not (
                param.offload_to_cpu
                and param.device.type == "cpu"  # where `.to(param.device)` copies nothing
                and param.sharded_state == ShardedState.SHARDED
                and not hasattr(param._sharded_local_tensor, "fsdp_pre_all_gather")
            ):
                return original.fget(param)
            self._copying = "h2d"
            try:
                on_device = param._sharded_param_data.clone()
            finally:
                self._copying = None
            self._update_and_maybe_create_winfos(on_device, self._ref_class.TEMP)
            dtype = param.param_dtype
            return [on_device if dtype is None or dtype == on_device.dtype else on_device.to(dtype)]

        FSDPParam.all_gather_inputs = property(all_gather_inputs)
        try:
            yield
        finally:
            FSDPParam.all_gather_inputs = original

    @contextlib.contextmanager
    def _gradients_to_host(self, groups):
        """Each offloading unit's post-backward, then its gradients handed to the host (the D2H copy)."""
        missing = object()
        saved = []

        def wrap(group, inner):
            @wraps(inner)
            def post_backward(*args, **kwargs):
                result = inner(*args, **kwargs)
                for param in group.fsdp_params:
                    grad = param.sharded_param.grad
                    if param.offload_to_cpu and grad is not None:
                        local = grad.to_local() if isinstance(grad, DTensor) else grad
                        self.costs[("d2h", 0, _nbytes(local), False, False)] += 1
                        self._to_host(grad)
                return result

            return post_backward

        for group in groups:
            saved.append((group, group.__dict__.get("post_backward", missing)))
            group.post_backward = wrap(group, group.post_backward)
        try:
            yield
        finally:
            for group, previous in reversed(saved):
                if previous is missing:
                    del group.post_backward
                else:
                    group.post_backward = previous

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
        before = {dev: n for dev, n in self._peak_mem.items() if dev != HOST}
        super()._update_peak_stats(peak_state)
        if {dev: n for dev, n in self._peak_mem.items() if dev != HOST} != before:
            self.peak_by_module = {k: v for k, v in self._act_by_module.items() if v}
        total = sum(snap[_TOTAL_KEY] for dev, snap in self._curr_mem_snap.items() if dev != HOST)
        self.phases.note(self._in_opt, self._mod_tracker.is_bw, self._innermost, total, self._curr_mem_snap)

    # --- the ops ---

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._propagating:
            if any(t is DTensor for t in types):
                return NotImplemented
            return func(*args, **(kwargs or {}))
        # An op over host tensors runs on the CPU, unless it is the copy to the accelerator.
        self._host_op = self._hosted and self._copying is None and self._on_host(args, kwargs)
        try:
            result = super().__torch_dispatch__(func, types, args, kwargs)
            if result is NotImplemented:  # a DTensor op, on its way to its local ops
                self.costs[("dtensor", 0, 0, False, self._recomputing())] += 1
            elif active_fake_mode() is self._fake_mode_on_entry:
                self._cost(func, args, kwargs or {}, result)
        finally:
            self._host_op = False
        return result

    def _recomputing(self) -> bool:
        # Recomputing a checkpointed forward: an op in backward with grad mode on (the engine runs
        # backward ops with it off).
        return self._in_recomputed_call or (self._mod_tracker.is_bw and torch.is_grad_enabled())

    @contextlib.contextmanager
    def recomputed_calls(self):
        """What runs inside counts as recomputation where the call began in one: a compiled module's forward
        runs inside an autograd.Function, with grad mode off, also when checkpointing recomputes it."""
        was = self._in_recomputed_call
        self._in_recomputed_call = self._recomputing()
        try:
            yield
        finally:
            self._in_recomputed_call = was

    def _cost(self, func, args, kwargs, result) -> None:
        packet = func.overloadpacket
        namespace = str(packet).partition(".")[0]
        if namespace in _COLLECTIVE_NAMESPACES or func.is_view or packet.__name__ in _FREE:
            return
        recomputed = self._recomputing() and not REPLAYING
        if self._copying is not None:  # a copy between host and accelerator: bytes over the host link
            copied = sum(_nbytes(t) for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor))
            self.costs[(self._copying, 0, copied, False, recomputed)] += 1
            return
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
            # A part over host tensors runs on the CPU (torch groups a step's tensors by device).
            on_device = False
            for i in range(len(lists[0])):
                part = [a[i] for a in lists if i < len(a)]
                moved = sum(map(_nbytes, part)) + sum(_nbytes(a[i]) for a in mutated if i < len(a))
                on_host = self._hosted and self._on_host(part, {})
                on_device |= not on_host
                self.costs[("cpu" if on_host else "part", 0, moved, _low(part), recomputed)] += 1
            if on_device:
                self.costs[("kernel", 0, 0, False, recomputed)] += 1
            return
        outputs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        if not outputs or packet.__name__ in _UNWRITTEN:  # metadata queries; allocations with no kernel
            return
        counter = _NOT_LISTED.get(packet) or flop_registry.get(packet)
        flops = int(counter(*args, **kwargs, out_val=result)) if counter is not None else 0
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        moved = sum(map(_nbytes, inputs)) + sum(map(_nbytes, outputs))
        self.costs[("cpu" if self._host_op else "kernel", flops, moved, _low(inputs), recomputed)] += 1

    # --- the result ---

    def peak(self) -> tuple[int, dict[str, int]]:
        """The accelerator's peak bytes and what was live at it, by explain's categories."""
        return _by_category(self._peak_mem_snap)

    def phase_peaks(self) -> dict[str, tuple[int, dict[str, int], dict[str, int]]]:
        """Each phase's peak bytes, what was live at it by category, and the activations by module then."""
        return {name: (n, _by_category(snap)[1], by) for name, (n, snap, by) in self.phases.peaks.items()}

    def host_peak(self) -> tuple[int, dict[str, int]]:
        """The most bytes the host held for offloading units at once, by category (0 without offload)."""
        return _by_category(self._peak_mem_snap, host=True)

    def reading(self) -> tuple[dict[str, int], dict[str, int]]:
        """What is live now and what was live at the peak since the last reading (or since the tracker
        was entered), by explain's categories; the next reading's peak starts from now (as `__enter__`
        starts the trackers' own). For a pipeline, whose microbatches are measured one phase at a time."""
        current, peak = _by_category(self._curr_mem_snap)[1], _by_category(self._peak_mem_snap)[1]
        self._restart_peaks(deepcopy(self._curr_mem_snap))
        return current, peak

    def _restart_peaks(self, now: dict) -> None:  # the peak, and each phase's, from `now` (a snapshot) on
        self._peak_mem_snap, self._peak_mem = now, {dev: snap[_TOTAL_KEY] for dev, snap in now.items()}
        self.phases.peaks.clear()


def _by_category(snapshots, host: bool = False) -> tuple[int, dict[str, int]]:
    """The accelerator's devices' snapshots (or the host's), totalled and by explain's categories."""
    total, by_category = 0, dict.fromkeys(ORDER, 0)
    for device, snapshot in snapshots.items():
        if (device == HOST) != host:
            continue
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
    """torch's FSDPMemTracker, which also takes a unit over several modules (`fully_shard([norm, output])`)
    as one. torch's hooks each of that unit's modules apart (torch 2.11-2.13), and the unit then gathers
    and reduces once per module: one all-gather and one reduce-scatter too many per step, and their memory.
    Here such a unit keeps fully_shard's group hooks, wrapped as torch's tracker wraps a single module's."""

    def __init__(self, model, optimizer, blocks=None):
        FSDPMemTracker.__init__(self, model, optimizer)
        self._setup_extension(model, optimizer, blocks)
        self._grouped: list[tuple] = []  # (FSDP state, its group's own pre_backward and post_backward)

    def _instrument_fsdp_module(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        states = {
            id(s): s for m in self._root_mod.modules() if isinstance(m, FSDPModule) for s in [m._get_fsdp_state()]
        }
        grouped = [s for s in states.values() if s._fsdp_param_group is not None and len(s._modules) > 1]
        with fsdp_param_groups_hidden(grouped):  # torch's instrumentation passes over these
            super()._instrument_fsdp_module()
        for state, group in ((s, s._fsdp_param_group) for s in grouped):
            first = state._modules[0]
            self._instrument_fsdp_sharded_params_grads(group)
            state._pre_forward_hook_handle.remove()  # one handle for the group's pre- and post-hooks
            handle = fsdp_group_forward_hooks(
                state,
                self._fsdp_state_pre_forward(first, state._pre_forward),
                self._fsdp_state_post_forward(first, state._post_forward),
            )
            state._pre_forward_hook_handle = state._post_forward_hook_handle = handle
            self._grouped.append((state, group.pre_backward, group.post_backward))
            group.pre_backward = self._fsdp_param_group_pre_backward(first, group.pre_backward)
            group.post_backward = self._fsdp_param_group_post_backward(first, group.post_backward)

    def _fsdp_param_group_post_backward(self, fsdp_mod, post_backward):
        """torch's wrapper reads each parameter's unsharded gradient before the unit's post-backward, but a
        unit whose forward did not run in the step was never gathered and has no unsharded parameters
        (DeepSeek V4's compressor norm in a layer that compresses nothing, torch 2.11-2.13): FSDP's own
        post-backward passes over it, and so does the tracking, which has nothing of it to count."""
        tracked = super()._fsdp_param_group_post_backward(fsdp_mod, post_backward)

        @wraps(post_backward)
        def inner(*args, **kwargs):
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            gathered = group is None or all(hasattr(p, "_unsharded_param") for p in group.fsdp_params)
            return (tracked if gathered else post_backward)(*args, **kwargs)

        return inner

    def _deregister_module_and_optimizer_hooks(self) -> None:
        super()._deregister_module_and_optimizer_hooks()
        for state, pre_backward, post_backward in self._grouped:
            state._pre_forward_hook_handle.remove()
            handle = fsdp_group_forward_hooks(state, state._pre_forward, state._post_forward)
            state._pre_forward_hook_handle = state._post_forward_hook_handle = handle
            state._fsdp_param_group.pre_backward = pre_backward
            state._fsdp_param_group.post_backward = post_backward
        self._grouped.clear()


class Tracker(Extension, MemTracker):
    def __init__(self, model, optimizer, blocks=None):
        MemTracker.__init__(self)
        self._setup_extension(model, optimizer, blocks)
        self.track_external(model, optimizer)

    def track_inputs(self, inputs) -> None:
        self.track_external(*[t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)])


def tracker(model, optimizer, blocks=None) -> Extension:
    """FSDPMemTracker for a model whose root is an FSDP2 unit, MemTracker for any other; `blocks` the
    repeated stack's path and keys, for each phase's peak (explain.phases)."""
    from torch.distributed.fsdp import FSDPModule

    kind = FSDPTracker if isinstance(model, FSDPModule) else Tracker
    return kind(model, optimizer, blocks)
