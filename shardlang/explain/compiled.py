"""What `compile` changes in explain's simulated step: the memory and the time of the modules (and the
loss) the plan compiles, as inductor would run them.

torch.compile cannot run inside the step (dynamo refuses to trace under a dispatch mode, and the
trackers are dispatch modes), so explain does what inductor does up to code generation, on the step's
fake tensors: AOTAutograd traces the compiled function's forward and backward into one graph, with
inductor's decompositions, and splits it with inductor's partitioner (`min_cut_rematerialization_partition`,
which recomputes cheap ops in the backward instead of saving their outputs). The two graphs then run
inside the step, under its trackers, with inductor's fusion modelled:

- Ops inductor calls out to a library for (matmuls, attention, convolutions, collectives, and any op
  it has no lowering for) run as they are: their memory and costs are tracked as in an eager step.
- Every other op is fused: the ops connected through values no library call reads form one kernel.
  Their intermediates are never allocated (they run outside the trackers); a value leaves the kernel
  (it is allocated, and written once) where a library call, a view or the graph's output reads it.
  The kernel reads each input it takes from outside it once. Its cost is those bytes at the HBM
  roofline, one launch.

What it leaves out: inductor sometimes splits a group in two (a reduction whose consumers iterate
another way) or re-reads an input (a reduction and its epilogue); it picks a matmul's kernel by tuning
(the roofline is the same). The partitioner's choice of saved values is exact for the graph traced.

Under activation checkpointing the compiled forward runs again in the backward, as checkpointing
recomputes it, its ops counted as recomputation.

Not modelled, run eager with a note: compiled modules whose parameters or inputs are DTensors (tensor
parallelism inside them), that hold another FSDP unit or hooks of their own inside; a loss over DTensor
logits (`loss_parallel`).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_flatten, tree_unflatten

#: Ops inductor hands to a library kernel (cuBLAS, cuDNN, flash attention) instead of generating code.
_EXTERN = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "convolution_backward",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_flash_attention_forward",
        "_flash_attention_backward",
        "_efficient_attention_forward",
        "_efficient_attention_backward",
        "_grouped_mm",
    }
)


#: Reductions (after inductor's decompositions): each makes a kernel its group's inputs are read by.
_REDUCTIONS = frozenset(
    {"sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "argmax", "argmin", "any", "all"}
)


def _lowered(target) -> bool:
    """Whether inductor generates code for `target` (it has a lowering that is not a fallback)."""
    from torch._inductor import lowering

    packet = getattr(target, "overloadpacket", None)
    if packet is None:
        return False
    if packet.__name__ in _EXTERN or str(packet).partition(".")[0] in ("_c10d_functional", "c10d"):
        return False
    fallback = getattr(lowering, "fallbacks", set())
    return (target in lowering.lowerings or packet in lowering.lowerings) and target not in fallback


class Modelled:
    """The step's tracker (an explain.memory Extension), which the graphs below report to."""

    #: The step running now (the one made last: a step makes its own before it runs, and steps run one at
    #: a time): a traced graph charges its forward's and its backward's runs to it.
    running: Modelled | None = None

    def __init__(self, tracker, plan):
        self.tracker, self.plan = tracker, plan
        Modelled.running = self
        self.warming = False  # the tracing call: nothing is charged
        #: What ran eager instead, and why: {what: reason}.
        self.eager: dict[str, str] = {}

    def loss(self, loss: Callable, **options) -> Callable:
        """`compile loss`, modelled (layout.loss's `compile_with`); torch.compile's options change nothing
        here."""
        return modelled(loss, self, f"`compile loss` (line {self.plan.compile_loss.span.line})", key=("loss", loss))


@contextlib.contextmanager
def _outside_modes() -> Iterator[None]:
    """No dispatch mode (the trackers, the recording fake mode) and no global module hook (the trackers'
    module tracking): tracing and fused ops are invisible to the step's accounting."""
    from torch.nn.modules import module as m
    from torch.utils._python_dispatch import _disable_current_modes

    names = [n for n in dir(m) if n.startswith("_global_") and n.endswith("hooks")]
    saved = {n: getattr(m, n) for n in names}
    try:
        for n in names:
            setattr(m, n, type(saved[n])())
        with _disable_current_modes():
            yield
    finally:
        for n, hooks in saved.items():
            setattr(m, n, hooks)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Run(fx.Interpreter):
    """One run of a forward or backward graph with inductor's fusion modelled (see the module's docstring)."""

    def __init__(self, gm: fx.GraphModule, modelled: Modelled):
        super().__init__(gm)
        self.modelled = modelled
        self.internal: dict[fx.Node, int] = {}  # fused node -> its kernel's group
        self.parent: list[int] = []
        # group -> {an input node: bytes}; by node, not by id(): a freed value's id is reused by a later one
        self.reads: dict[int, dict[fx.Node, int]] = {}
        self.writes: dict[int, int] = {}  # group -> bytes written out
        self.low: dict[int, bool] = {}
        self.reductions: dict[int, int] = {}  # group -> reductions in it

    def _find(self, g: int) -> int:
        while self.parent[g] != g:
            self.parent[g] = self.parent[self.parent[g]]
            g = self.parent[g]
        return g

    def _union(self, groups: list[int]) -> int:
        if not groups:
            self.parent.append(len(self.parent))
            return self.parent[-1]
        roots = sorted({self._find(g) for g in groups})
        for r in roots[1:]:
            self.parent[r] = roots[0]
        return roots[0]

    def _materialise(self, node: fx.Node, value):
        """A fused value read outside its kernel: allocated (tracked) and written once."""
        if node not in self.internal or not isinstance(value, torch.Tensor):
            return value
        group = self._find(self.internal.pop(node))
        self.writes[group] = self.writes.get(group, 0) + _nbytes(value)
        out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
        self.env[node] = out
        return out

    def run_node(self, node: fx.Node):
        if node.op != "call_function":
            return super().run_node(node)
        if node.target is operator.getitem and node.args[0] in self.internal:
            # One output of a fused multi-output op (var_mean, say): part of its kernel.
            value = super().run_node(node)
            self.internal[node] = self.internal[node.args[0]]
            return value
        packet = getattr(node.target, "overloadpacket", None)
        is_view = packet is not None and (node.target.is_view or packet.__name__ in ("t", "view", "_unsafe_view"))
        fused_inputs = [n for n in node.all_input_nodes if n in self.internal]
        if _lowered(node.target) and not (is_view and not fused_inputs):
            with _outside_modes(), self._factory(node):
                value = super().run_node(node)
            group = self._union([self.internal[n] for n in fused_inputs])
            for n in node.all_input_nodes:
                if n not in self.internal and isinstance(self.env.get(n), torch.Tensor):
                    t = self.env[n]
                    self.reads.setdefault(group, {})[n] = _nbytes(t)
                    self.low[group] = self.low.get(group, False) or t.dtype in (torch.bfloat16, torch.float16)
            self.internal[node] = group
            if packet.__name__ in _REDUCTIONS:
                self.reductions[group] = self.reductions.get(group, 0) + 1
            return value
        for n in fused_inputs:
            self._materialise(n, self.env[n])
        return super().run_node(node)

    def _factory(self, node: fx.Node):
        """The step's fake mode for an op that takes no tensor (`zeros`, `arange`, `empty`): outside every
        mode it would make a real tensor, and a real `empty`'s garbage used as indices (an MoE's token
        positions) sent a custom op to its real kernel, which read out of bounds."""
        takes = any(isinstance(self.env.get(n), torch.Tensor) for n in node.all_input_nodes)
        return contextlib.nullcontext() if takes or self.fake_mode is None else self.fake_mode

    def run(self, *args):
        self.fake_mode = detect_fake_mode(list(args))
        out = super().run(*args, enable_io_processing=False)
        # What the graph returns leaves its kernels (saved activations, gradients, outputs).
        flat, spec = tree_flatten(out)
        outputs = next(n for n in reversed(self.module.graph.nodes) if n.op == "output")
        nodes, _ = tree_flatten(outputs.args[0])
        flat = [self._materialise(n, v) if isinstance(n, fx.Node) else v for n, v in zip(nodes, flat)]
        self._charge()
        return tree_unflatten(flat, spec)

    def _charge(self) -> None:
        if self.modelled.warming:
            return
        tracker = self.modelled.tracker
        recomputed = tracker._recomputing()
        groups: dict[int, list[int]] = {}
        for g in range(len(self.parent)):
            groups.setdefault(self._find(g), []).append(g)
        for members in groups.values():
            read = {}
            for g in members:
                read.update(self.reads.get(g, {}))
            passes = max(1, sum(self.reductions.get(g, 0) for g in members))
            moved = passes * sum(read.values()) + sum(self.writes.get(g, 0) for g in members)
            low = any(self.low.get(g, False) for g in members)
            tracker.costs[("kernel", 0, moved, low, recomputed)] += 1


#: The functions traced so far in this process, by what makes two calls trace the same graph (`_call`):
#: AOTAutograd's tracing is most of a compiled candidate's time, and the steps of one explain (2, 3 and 4
#: blocks) and the candidates a search worker explains one after another trace the same blocks.
_TRACED: dict[Any, Callable] = {}


def _executor():
    def compiler(gm: fx.GraphModule, example_inputs):
        def run(args):
            return _Run(gm, Modelled.running).run(*args)

        run._boxed_call = True
        return run

    return compiler


def _traced(fn: Callable):
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    compiler = _executor()
    return aot_function(
        fn,
        fw_compiler=compiler,
        bw_compiler=compiler,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )


def _meta(value) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, value.requires_grad)
    return ("value", repr(value))


def _call(modelled: Modelled, key: Any, fn: Callable, tensors: list[torch.Tensor]) -> Any:
    """fn(*tensors) as inductor would run it (see the module's docstring), traced once per `key` and
    the tensors' shapes (the same graph for every module of one structure)."""
    full_key = (key, tuple(_meta(t) for t in tensors))
    compiled = _TRACED.get(full_key)
    if compiled is None:
        compiled = _traced(fn)
        # AOTAutograd traces at the first call: outside the step's accounting, once; its outputs dropped.
        modelled.warming = True
        fake = detect_fake_mode(tensors)  # kept: a value made outside it would be real, an `empty` garbage
        # What it saves for its backward stays its own: activation checkpointing around the module counts
        # what is saved in the forward and again in the recomputation, which traces nothing.
        own = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        try:
            with _outside_modes(), fake or contextlib.nullcontext(), own:
                compiled(*tensors)
        finally:
            modelled.warming = False
        _TRACED[full_key] = compiled
    with modelled.tracker.recomputed_calls():
        return compiled(*tensors)


def modelled(
    fn: Callable,
    modelled: Modelled,
    what: str,
    state: Callable[[], dict[str, torch.Tensor]] | None = None,
    key=(),
):
    """`fn` as its compiled version would run (see the module's docstring); `what` names it in notes.
    `state`: the tensors it reads besides its arguments, by name (a module's parameters and buffers as
    they are at the call: FSDP's gathered ones), handed to the traced function as inputs and put in
    place for the call. Over DTensors it runs eager, noted in `modelled.eager`."""
    from torch.distributed.tensor import DTensor

    def call(*args, **kwargs):
        from torch.nn.utils.stateless import _reparametrize_module

        held = state() if state is not None else {}
        names = list(held)
        leaves, spec = tree_flatten((args, kwargs))
        slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if any(isinstance(t, DTensor) for t in [*held.values(), *(leaves[i] for i in slots)]):
            modelled.eager.setdefault(what, "it computes on DTensors (tensor parallelism)")
            return fn(*args, **kwargs)

        def traced(*tensors):
            rest = list(leaves)
            for i, t in zip(slots, tensors[len(names) :]):
                rest[i] = t
            a, k = tree_unflatten(rest, spec)
            if not names:
                return fn(*a, **k)
            with _reparametrize_module(fn.__self__, dict(zip(names, tensors[: len(names)]))):
                return fn(*a, **k)

        static = tuple((i, _meta(x)) for i, x in enumerate(leaves) if i not in slots)
        tensors = [held[n] for n in names] + [leaves[i] for i in slots]
        return _call(modelled, (key, static, str(spec)), traced, tensors)

    return call


def module_forward(module: nn.Module, modelled_: Modelled, what: str):
    """A forward for `module` that runs as its compiled forward would (its hooks stay around it)."""

    def state() -> dict[str, torch.Tensor]:
        return {**dict(module.named_parameters()), **dict(module.named_buffers())}

    return modelled(module.forward, modelled_, what, state, key=_structure(module))


def _structure(module: nn.Module) -> tuple:
    """What makes two modules trace the same graph: their classes, shapes (str) and the plain attributes of
    each submodule (a layer index that picks sliding-window attention, say)."""
    plain = (bool, int, float, str, type(None))
    return tuple(
        (name, type(m), tuple(sorted((k, v) for k, v in vars(m).items() if isinstance(v, plain))))
        for name, m in module.named_modules()
    ) + (str(module),)


@contextlib.contextmanager
def compiled_modules(model: nn.Module, compiled, modelled_: Modelled) -> Iterator[None]:
    """Each module the plan compiles (`compiled`: (fqn, ir.Compile) pairs) runs as compiled for the
    length of the block, except those `unsupported` says cannot be modelled: they run eager, noted in
    `modelled_.eager` by statement. Under activation checkpointing the compiled forward runs again in the
    backward, as checkpointing recomputes it."""
    patched = []
    for fqn, statement in compiled:
        module = model.get_submodule(fqn)
        what = f"`compile {statement.target}` (line {statement.span.line})"
        reason = unsupported(module)
        if reason is not None:
            modelled_.eager[what] = reason
            continue
        patched.append((module, module.__dict__.get("forward")))
        module.forward = module_forward(module, modelled_, what)
    try:
        yield
    finally:
        for module, own in patched:
            if own is None:
                del module.forward
            else:
                module.forward = own


def unsupported(module: nn.Module) -> str | None:
    """Why a compiled module's run cannot be modelled (it then runs eager), or None."""
    from torch.distributed.fsdp import FSDPModule

    for name, inner in module.named_modules():
        if name and isinstance(inner, FSDPModule):
            return f"it holds another FSDP unit ({name})"
        if name and (inner._forward_pre_hooks or inner._forward_hooks):
            return f"{name} inside it has hooks of its own"
    return None


def notes(plan, eager: dict[str, str]) -> tuple[str, ...]:
    """explain's notes on a plan's `compile` statements: how they are modelled, and what ran eager."""
    if not plan.compiles and plan.compile_loss is None:
        return ()
    found = [
        "compile modelled as inductor runs it: AOTAutograd's graphs with inductor's decompositions and "
        "partitioner, each group of connected non-library ops one fused kernel (docs/explain.md)"
    ]
    by_reason: dict[str, list[str]] = {}
    for what, reason in eager.items():
        by_reason.setdefault(reason, []).append(what)
    for reason, whats in by_reason.items():
        found.append(f"not modelled for {', '.join(whats)}: {reason}; stepped eager")
    return tuple(found)
