"""comms: the collectives of one forward and backward pass, counted by torch op name; always
reported, compared with the counts the plan gives (`comms(all_reduce=2, total=3)`).

Counted: the model's forward, the loss and the backward (recomputation under activation
checkpointing included: it really communicates). Not counted: reassembling an output that TP ranks
hold in slices (`output=shard(D)`), which only the checks do.

The counting is a dispatch mode of our own with CommDebugMode's names (`all_reduce`,
`all_gather_into_tensor`, `_allgather_base_`, ...): CommDebugMode's module tracker fails under
activation checkpointing (a KeyError on the recomputed module in torch 2.13).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import layout as lay
from .outcome import FAIL, PASS, REPORTED, SKIPPED, Outcome
from .step import Step

#: The ops that are collectives, as CommDebugMode counts them: c10d's and the functional ones.
FUNCTIONAL_COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "all_to_all_single",
        "broadcast",
    }
)
C10D_COLLECTIVES = frozenset(
    {
        "_allgather_base_",
        "_reduce_scatter_base_",
        "allgather_",
        "allgather_coalesced_",
        "allgather_into_tensor_coalesced_",
        "allreduce_",
        "allreduce_coalesced_",
        "alltoall_",
        "alltoall_base_",
        "broadcast_",
        "gather_",
        "scatter_",
        "reduce_",
        "reduce_scatter_",
        "reduce_scatter_tensor_coalesced_",
    }
)
FUNCTIONAL = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def op_name(op) -> str:
    """`c10d_functional.all_reduce` -> `all_reduce`: torch's op name without its namespace."""
    return str(op).split(".")[-1] if "." in str(op) else str(op)


def collective(func) -> str | None:
    """The collective's name if `func` (an op overload) is one, else None."""
    namespace, _, name = str(func.overloadpacket).partition(".")
    if (namespace == "c10d" and name in C10D_COLLECTIVES) or (
        namespace in FUNCTIONAL and name in FUNCTIONAL_COLLECTIVES
    ):
        return name
    return None


class Calls:
    """Collectives seen: (op name, process group name, bytes of the full buffer: the gathered tensor of
    an all-gather, the input of a reduce-scatter or all-reduce)."""

    def __init__(self):
        self.calls: list[tuple[str, str, int]] = []
        self._known: dict = {}

    def note(self, func, args) -> None:
        name = self._known.get(func, False)
        if name is False:
            name = self._known[func] = collective(func)
        if name is not None:
            self.calls.append((name, _group(args), _bytes(name, args)))

    @contextlib.contextmanager
    def paused(self):
        """Not noting for a while (reassembling an output is the check's work, not the model's)."""
        calls = list(self.calls)
        try:
            yield
        finally:
            del self.calls[len(calls) :]

    def counts(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for name, _, _ in self.calls:
            found[name] = found.get(name, 0) + 1
        return dict(sorted(found.items()))


class Recorder(Calls, TorchDispatchMode):
    """A dispatch mode noting every collective that runs under it."""

    def __init__(self):
        Calls.__init__(self)
        TorchDispatchMode.__init__(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Modes run before tensor subclasses: let DTensor desugar its op into local ops and collectives
        # first (they come back through this mode), as CommDebugMode does.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        self.note(func, args)
        return func(*args, **(kwargs or {}))


def _group(args) -> str:
    """The process group a collective runs on, by name: functional ops pass the name, c10d ops the group."""
    named = next((a for a in args if isinstance(a, str) and a.isdigit()), None)
    if named is not None:
        return named
    boxed = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
    return dist.ProcessGroup.unbox(boxed).group_name if boxed is not None else "?"


def _bytes(name: str, args) -> int:
    tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    largest = max((t.numel() * t.element_size() for t in tensors), default=0)
    if name == "all_gather_into_tensor":  # functional all-gather: only the local input is an argument
        largest *= dist.get_world_size(dist.distributed_c10d._resolve_process_group(_group(args)))
    return largest


@contextlib.contextmanager
def _point_to_point(calls: Calls):
    """Note a pipeline's sends and receives as `send` and `recv`: torch's schedules issue them as
    dist.P2POp objects through the process group directly, unseen by a dispatch mode, so each P2POp
    made while the step runs is noted."""
    real = dist.P2POp.__init__

    def noted(self, op, tensor, *args, **kwargs):
        real(self, op, tensor, *args, **kwargs)
        kind = "send" if op in (dist.isend, dist.send) else "recv"
        group = getattr(self.group, "group_name", "?")
        calls.calls.append((kind, group, tensor.numel() * tensor.element_size()))

    dist.P2POp.__init__ = noted
    try:
        yield
    finally:
        dist.P2POp.__init__ = real


def count_collectives(ctx, model, recorder: Calls | None = None) -> dict[str, int]:
    """Collectives of one forward, loss and backward of `model`, with the inputs and loss the checks
    use for this plan (the reassembly of a sliced output is not counted: only the checks do it).
    `recorder`: where to note them (a Recorder, or a mode already active that notes them itself).

    Modules the plan compiled run eagerly meanwhile: a dispatch mode cannot run inside compiled code
    (torch refuses: "non-infra torch dispatch mode present"). The same modules, hooks and collectives;
    the counts a plan's `comms(...)` expects are the eager ones."""
    with lay.modules_eagerly(ctx.plan):
        return _count_collectives(ctx, model, recorder)


def _count_collectives(ctx, model, recorder: Calls | None) -> dict[str, int]:
    step = Step.of(ctx)
    recorder = recorder if recorder is not None else Recorder()
    noting = recorder if isinstance(recorder, TorchDispatchMode) else contextlib.nullcontext()
    if ctx.pipeline is not None:
        full = step.batch(size=2 * ctx.pipeline.microbatches)
        ctx.pipeline.step(*step.share(full))  # the first step also sends the stages' shapes: count a later one
        with noting, _point_to_point(recorder):
            step.scheduled(lambda inputs: ctx.pipeline.step(*inputs), full, ctx.pipeline.microbatches)
        model.zero_grad(set_to_none=True)
        return recorder.counts()
    full = step.batch()
    with noting:
        output = step.forward(model, full)
    with recorder.paused():
        whole = step.whole(output)
    with noting:
        step.backward(step.loss(whole, full))
    model.zero_grad(set_to_none=True)
    return recorder.counts()


def run(ctx, check) -> Outcome:
    if ctx.model_file.example_input is None:
        return Outcome(SKIPPED, "not run: the model file defines no example_input(batch, generator)")
    counts = count_collectives(ctx, ctx.model)
    total = sum(counts.values())
    expected = dict(check.args)
    data = {"counts": counts, "total": total, "expected": expected}
    wrong = [
        f"{k}: expected {n}, counted {total if k == 'total' else counts.get(k, 0)}"
        for k, n in expected.items()
        if (total if k == "total" else counts.get(k, 0)) != n
    ]
    shown = ", ".join(f"{k}={n}" for k, n in counts.items()) or "none"
    if wrong:
        return Outcome(FAIL, f"{'; '.join(wrong)} (counted {shown})", data)
    counted = f"{total} collective{'' if total == 1 else 's'} ({shown})"
    if not expected:
        return Outcome(REPORTED, f"{counted}; not compared: the plan gives no counts, e.g. comms(total={total})", data)
    return Outcome(PASS, f"{counted}; as expected", data)
