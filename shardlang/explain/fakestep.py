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
from attrs import field, frozen

from ..frontend.diagnostics import few


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
    #: Each phase's peak and the gradients live then (explain.phases): what accumulating gradients over
    #: micro-batches adds at each moment of the later ones. Not compared: an extrapolated step leaves out a
    #: phase that cannot be the highest.
    phases: tuple[tuple[str, int, int], ...] = field(default=(), eq=False)

    def category(self, name: str) -> int:
        return dict(self.categories).get(name, 0)

    def accumulating(self) -> int:
        """The peak of a micro-batch after the first, where gradients accumulate over micro-batches (reduced
        every micro-batch, as torchtitan's trainer does): every gradient is live from the micro-batch's
        start, so each phase peaks that much higher than it did with only its own gradients. The step's
        own peak where no phase was recorded."""
        whole = max((grads for _, _, grads in self.phases), default=0)
        return max((n + whole - grads for _, n, grads in self.phases), default=self.bytes)


def recording_fake_mode(recorder, stand_ins: StandIns | None = None):
    """A FakeTensorMode (non-fake inputs allowed) that also notes each collective on `recorder` (a
    verification.comms.Calls): one dispatch mode instead of two. With `stand_ins` (lint's step), an op
    fake tensors cannot run runs on stand-ins instead of raising (StandIns)."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensor,
        FakeTensorMode,
    )

    plain = (FakeTensor, torch.Tensor, nn.Parameter)  # the types FakeTensorMode runs itself

    class RecordingFakeMode(FakeTensorMode):
        #: RANDOM_SCALARS' values: `redraw()` before each model's run, so the unsharded model and the plan's
        #: make the same decisions (skip the same layers)
        draws = torch.Generator().manual_seed(0)

        def redraw(self) -> None:
            self.draws.manual_seed(0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t not in plain for t in types):
                # A DTensor op: let DTensor desugar it into local ops and collectives, which come back
                # here. FakeTensorMode would say the same, but only after missing its cache (22,000
                # such misses in the 80-layer step).
                return NotImplemented
            recorder.note(func, args)
            if stand_ins is not None:
                refuse_mixed_dtypes(func, args, products=not stand_ins.uncast_units)
            if stand_ins is not None and func in GROUPED_MM and stand_ins.refused_dtype(args):
                run = super().__torch_dispatch__
                return stand_ins.in_bf16(lambda a, k: run(func, types, a, k), args, kwargs or {})
            if func in RANDOM_SCALARS:
                return drawn(self, super().__torch_dispatch__(func, types, args, kwargs), self.draws)
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            except (DynamicOutputShapeException, DataDependentOutputException):
                if stand_ins is None:
                    raise
                return stand_ins.run(self, func, args, kwargs or {})

    return RecordingFakeMode(allow_non_fake_inputs=True)


#: Uniform draws the model may branch on (`torch.rand([]) < layerdrop`, transformers' LayerDrop): a draw of
#: one value is made for real (from a generator of the step's own), kept by its fake tensor, and what the
#: model decides from it is one decision a worker may make; a fake one could not be read at all, and a
#: stand-in of ones skipped every layer.
RANDOM_SCALARS = frozenset({torch.ops.aten.rand.default, torch.ops.aten.rand_like.default})


def copy_model(model: nn.Module) -> nn.Module:
    """`copy.deepcopy(model)`, its fake tensors' fake modes shared with the copy rather than copied. A copied
    mode copies its converter's storage weak references (torch's StorageWeakRef, which has no copy of its own:
    the original and the copy each free the one reference they share), a double free that corrupted the heap
    of lint's step on a later allocation (a SIGABRT, "corrupted double-linked list", in some runs of
    mixtral_ep's step: expert parallelism's counts are constants the mode keeps)."""
    import copy
    import itertools

    memo = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        mode = getattr(getattr(t, "_local_tensor", t), "fake_mode", None)
        if mode is not None:
            memo[id(mode)] = mode
    return copy.deepcopy(model, memo)


def drawn(mode, fake: torch.Tensor, draws: torch.Generator) -> torch.Tensor:
    """`fake` (a uniform draw) with a value: drawn for real where it holds one value on the CPU."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if fake.numel() != 1 or fake.device.type != "cpu":
        return fake
    with unset_fake_temporarily():
        real = torch.rand(fake.shape, dtype=fake.dtype, generator=draws)
    return mode.fake_tensor_converter.from_real_tensor(mode, real, make_constant=True)


#: The ops whose output's size depends on their input's values where a stand-in of ones (a mask all true)
#: is a value the input may have: what follows is a run the model could make. Every other data-dependent op
#: (`.item()`, `unique`, `bincount`, ...) gets a value the model may never see, and what follows is a guess.
WHOLE_MASK = frozenset({"aten::nonzero", "aten::masked_select", "aten::argwhere"})
GROUPED_MM = frozenset({torch.ops.aten._grouped_mm.default})


#: Products whose floating operands the CPU and CUDA kernels require in one dtype, which some of torch's fake
#: kernels (torch 2.11's matmul, 2.13's addmm) do not check: a float32 activation met by a bf16 weight under
#: `mixed_precision(param=bf16)` (a mask buffer kept in float32) raises on the workers, and so here.
SAME_DTYPE = frozenset(
    getattr(torch.ops.aten, name).default for name in ("mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "dot")
)
NORMS = frozenset({torch.ops.aten.native_layer_norm.default})
REDUCED = (torch.bfloat16, torch.float16)


def refuse_mixed_dtypes(func, args, products: bool = True) -> None:
    """Raise as the CPU and CUDA kernels do where lint's fake step would otherwise run on: a product of
    floating operands of different dtypes (SAME_DTYPE; not with `products` false), a layer norm whose weight
    is in a dtype its input does not take (a float32 input takes only float32 parameters; a bf16 or fp16 one
    its own or float32)."""
    if func in SAME_DTYPE and products:
        dtypes = [t.dtype for t in args if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if len(set(dtypes)) > 1:
            raise RuntimeError(
                f"expected the operands of {func._schema.name} to have the same dtype, but got: "
                f"{', '.join(str(d).removeprefix('torch.') for d in dtypes)}"
            )
    elif func in NORMS:
        x, params = args[0], [t for t in args[2:4] if isinstance(t, torch.Tensor)]
        allowed = {x.dtype, torch.float32} if x.dtype in REDUCED else {x.dtype}
        wrong = [t.dtype for t in params if t.dtype not in allowed]
        if wrong:
            raise RuntimeError(
                f"mixed dtype: layer_norm of a {str(x.dtype).removeprefix('torch.')} input takes parameters of "
                f"{' or '.join(sorted(str(d).removeprefix('torch.') for d in allowed))}, not "
                f"{str(wrong[0]).removeprefix('torch.')}"
            )


@frozen
class StandIn:
    """One op that fake tensors could not run, run on stand-ins by module `module` (its name, None
    outside every module); `sound`: on values its input may have (WHOLE_MASK)."""

    op: str
    module: str | None
    sound: bool


class StandIns:
    """Lint's step runs through what fake tensors cannot run, rather than reporting the model's code as the
    plan's fault: an op whose output depends on its input's values (`nonzero` in transformers' experts loop,
    `.item()`) runs on real tensors of ones of its inputs' shapes, its output made fake again (so every
    expert is hit, by every token); `torch._grouped_mm` in float32, which the meta kernel refuses as CUDA's
    does (CPU's takes it), runs in bf16 and is cast back. Each is kept (`seen`) for the step's note, and
    `guessed` tells whether one gave a value the model may never see, after which a failure is no finding.
    `where()` names the module running."""

    def __init__(self, where=None):
        self.where = where or (lambda: None)
        self.seen: list[StandIn] = []
        self.float32_grouped_mm: list[str | None] = []
        #: units with mixed_precision over one rank or beside tp whose parameters fake tensors leave uncast on this torch
        #: (torchcompat.fake_fsdp_casts_one_rank_units): their products' dtypes go unchecked, and the note says so
        self.uncast_units: tuple[str, ...] = ()

    @property
    def guessed(self) -> bool:
        return any(not s.sound for s in self.seen)

    def clear(self) -> None:
        self.seen.clear()
        self.float32_grouped_mm.clear()

    def notes(self) -> tuple[str, ...]:
        """The step's notes on what it ran on stand-ins, and what it could not check."""
        notes = []
        if self.uncast_units:
            notes.append(
                f"the dtypes of products in fully_shard units with mixed_precision over one rank or beside tp "
                f"({', '.join(self.uncast_units)}) not checked: under fake tensors torch {torch.__version__} "
                "leaves their parameters uncast (apply runs them)"
            )
        for sound, how in ((True, "masks all true"), (False, "tensors of ones where fake tensors held no value")):
            seen = [s for s in self.seen if s.sound == sound]
            if seen:
                ops = ", ".join(sorted({s.op.removeprefix("aten::") for s in seen}))
                notes.append(f"{ops} {_in_modules(s.module for s in seen)} read tensor values: the step ran on {how}")
        if self.float32_grouped_mm:
            notes.append(
                f"torch._grouped_mm ran in float32 {_in_modules(self.float32_grouped_mm)}, as CPU's kernel takes "
                "it (CUDA's takes only bf16: mixed_precision(param=bf16) on their units, or "
                "config._experts_implementation = 'eager')"
            )
        return tuple(notes)

    def after_guess(self, message: str) -> str:
        """The note that stands for a failure (`message`) after a stand-in gave a value the model may never
        see."""
        guess = next(s for s in self.seen if not s.sound)
        return (
            f"the step stopped: after {guess.op.removeprefix('aten::')} {_in_modules([guess.module])} read a value "
            f"fake tensors do not hold (it was given ones), {message}; that may come of the value it was given, "
            "so it is left to apply's checks"
        )

    def run(self, mode, func, args, kwargs):
        """`func` on real tensors: each fake argument's values where fake tensors kept them (a constant),
        else ones of its shape and dtype; its tensors made fake again, keeping their values (nonzero's
        indices, which the experts loop reads back), as fake tensors keep a small tensor's."""
        from torch.utils._pytree import tree_map

        name = func._schema.name
        self.seen.append(StandIn(name, self.where(), name in WHOLE_MASK))

        def real(x):
            if not _fake(x):
                return x
            return x.constant if x.constant is not None else torch.ones(x.shape, dtype=x.dtype)

        result = func(*tree_map(real, args), **tree_map(real, kwargs))
        converter = mode.fake_tensor_converter
        return tree_map(
            lambda x: converter.from_real_tensor(mode, x, make_constant=True) if isinstance(x, torch.Tensor) else x,
            result,
        )

    @staticmethod
    def refused_dtype(args) -> bool:
        return any(t.is_floating_point() and t.dtype != torch.bfloat16 for t in _tensors(args))

    def in_bf16(self, call, args, kwargs):
        """`call(args, kwargs)` with their floating tensors in bf16, its output cast back to the first's
        dtype (where `out_dtype` names none)."""
        from torch.utils._pytree import tree_map

        self.float32_grouped_mm.append(self.where())
        dtype = kwargs.get("out_dtype") or next(t.dtype for t in _tensors(args) if t.is_floating_point())
        return call(tree_map(_bf16, args), tree_map(_bf16, kwargs)).to(dtype)


def _in_modules(names) -> str:
    """`in a, b` for the modules named ("": the root's own forward; None: in a backward, outside every
    module's forward)."""
    named = sorted({n or "the model's own forward" for n in names if n is not None})
    return f"in {few(named, 3)}" if named else "in the backward"


def _bf16(x):
    return x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _tensors(args) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [a for a in tree_leaves(args) if isinstance(a, torch.Tensor)]


def _fake(x) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


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


@contextlib.contextmanager
def positions_as_on_real_tensors() -> Iterator[None]:
    """transformers reads packed sequences off the position ids where it can read their values, and takes
    every fake tensor for packed ones (`is_tracing`): on fake positions it builds an explicit mask where the
    real run has none and keeps SDPA's is_causal, and models whose attention differs with a mask took that
    other branch (Youtu's grouped keys, repeated twice over with a mask, raised in the unsharded model as
    in every sharded one, and lint's step stopped with no finding). Here, as on the workers: fake positions
    whose values fake tensors kept are read, any others (the model's own arange, of one sequence) are one
    sequence. A no-op where transformers is not imported."""
    import sys

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def find(position_ids):
        if not _fake(position_ids):
            return original(position_ids)
        if position_ids.constant is None:
            return None
        with unset_fake_temporarily():  # read as the workers read them
            return original(position_ids.constant)

    masking.find_packed_sequence_indices = find
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


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
