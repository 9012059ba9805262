"""The unsharded references of the gradients check and the tolerance rule they give (docs/checks.md).

The truth is the unsharded model in float64; kernels without a float64 version (torch._grouped_mm, which
transformers' mixtures of experts run on) are computed by float64 replacements (truth.py). Where the
float64 truth still fails, it is the model in float32, and its own error is measured on every step: a
bfloat16 copy computes the step too, and the float32 truth's error is taken as that copy's distance from
it times eps(float32) / eps(bfloat16) (rounding error grows in proportion to the unit roundoff).

A second reference computes in the precision the sharded model does: its parameters' dtype, with each
fully_shard unit's `mixed_precision` emulated (parameters cast, inputs and outputs cast as FSDP does, and
each replica's gradient added to the others' in the `reduce` dtype, rounding after each addition, as the
reduction does). Its distance from the truth is the rounding error of that precision on these very
inputs, and a sharded result may be K times as far from the truth (plus the truth's own measured error,
and a floor of K float32 roundings of the step's typical value, for tensors whose true value is zero). A
third copy, in the sharded parameters' dtype, is what the reference optimizer updates.
"""

from __future__ import annotations

import copy
import math

import torch
from attrs import frozen
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from ..runtime.gathering import whole
from . import layout as lay
from .routing import Replay, replay_under
from .truth import Float64Kernels, run_forward_under

#: How many times the reference's own rounding error a sharded result may be off by. A sharded run
#: rounds more often than the unsharded one (each TP rank's partial sums are rounded before they are
#: added): measured on CPU in bf16, correct plans reach 6x the reference's error (0.5 of the limit),
#: while one KV head of eight left untrained is 25x to 47x (2x to 4x the limit).
K = 12.0


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective on its mesh; runtime.gathering.whole); a plain tensor as it is."""
    return whole(tensor) if isinstance(tensor, DTensor) else tensor


def rounding_error(truth: torch.Tensor, same: torch.Tensor | None) -> float:
    if same is None:
        return 0.0
    return float((same.detach().to(truth.device).double() - truth).norm())


def allowed_error(truth: torch.Tensor, same: torch.Tensor | None, scale: float, fixed, own: float = 0.0) -> float:
    """The error a sharded tensor may have against `truth`: K times the same-precision reference's (`same`),
    or the fixed rule. `own` is the truth's own measured error (0 for the float64 truth): the reference's
    distance may be short of its error by as much, and the sharded result's by as much again."""
    n = max(truth.numel(), 1)
    if fixed is not None:
        rtol, atol = fixed
        return rtol * float(truth.norm()) + atol * math.sqrt(n)
    floor = K * torch.finfo(torch.float32).eps * scale * math.sqrt(n)
    return K * (rounding_error(truth, same) + own) + own + floor


#: The fewest values a slice holds for it to be compared on its own (below, one slice's rounding error is
#: too often small by luck).
SLICE_VALUES = 16


@frozen
class SliceError:
    """The worst slice of a difference along one dim against its own allowance: along `dim`, the slices
    in `over` (indices, ascending) are more than allowed, the worst of them `index`, `ratio` times."""

    dim: int
    size: int
    index: int
    error: float
    allowed: float
    ratio: float
    over: tuple[int, ...]

    def describe(self) -> str:
        runs, start = [], self.over[0]
        for a, b in zip(self.over, (*self.over[1:], None)):
            if b != a + 1:
                runs.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        return (
            f"slices {', '.join(runs)} along dim {self.dim} ({len(self.over)} of {self.size}), slice "
            f"{self.index} by {self.error:.3g}, {self.ratio:.3g} x its allowed {self.allowed:.3g}"
        )


def worst_slice(
    difference: torch.Tensor, truth: torch.Tensor, same: torch.Tensor | None, scale: float, own: float = 0.0
) -> SliceError | None:
    """A difference of `truth`'s shape, slice by slice along each dim (every slice of at least SLICE_VALUES
    values), for a fault confined to a few rows, which a whole tensor's rounding error hides: transformers'
    MLA leaves 8 of the 40 rows of kv_a_proj_with_mqa's gradient unreduced without its style, 100 x their own
    rounding error and 0.2 x the whole tensor's. A slice may differ by what the whole tensor may, applied to
    the slice: K times the reference's rounding error in that slice, taken no smaller than the whole tensor's
    relative rounding error times the slice's size (one slice's rounding can be small by luck). None if no
    slice has enough values."""
    if same is None or difference.dim() < 1:
        return None
    difference, truth, same = difference.double(), truth.double(), same.to(truth.device).double()
    norm = float(truth.norm())
    relative = float((same - truth).norm()) / norm if norm > 0 else 0.0
    worst = None
    for dim, size in enumerate(truth.shape):
        values = truth.numel() // max(size, 1)
        if size < 2 or values < SLICE_VALUES:
            continue
        others = [d for d in range(truth.dim()) if d != dim]
        error = _norms(difference, others)
        rounding = torch.maximum(_norms(same - truth, others), relative * _norms(truth, others))
        floor = K * torch.finfo(torch.float32).eps * scale * math.sqrt(values)
        allowed = K * (rounding + own) + own + floor
        ratios = error / allowed.clamp_min(torch.finfo(torch.float64).tiny)
        at = int(ratios.argmax())
        if worst is None or float(ratios[at]) > worst.ratio:
            over = tuple(int(i) for i in (ratios > 1.0).nonzero().flatten())
            worst = SliceError(dim, size, at, float(error[at]), float(allowed[at]), float(ratios[at]), over)
    return worst


def _norms(tensor: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """The 2-norm of each slice over `dims`, for a tensor of any rank: `Tensor.norm(dim=...)` takes a 2-tuple
    of dims as a matrix norm and refuses three (a Conv2d's 4-D weight)."""
    return torch.linalg.vector_norm(tensor, dim=dims) if dims else tensor.abs()


#: The coarser copy that measures a float32 truth's own error, and how much less float32 rounds than it.
COARSE = torch.bfloat16
COARSE_RATIO = torch.finfo(torch.float32).eps / torch.finfo(COARSE).eps


class References:
    """The unsharded models of one rank: the truth (float64, or float32 where float64 fails), one computing
    in the sharded model's precision, and one whose parameters the reference optimizer updates (the
    sharded parameters' dtype)."""

    def __init__(self, truth, same, optimizer, precision: str, kernels: Float64Kernels):
        self.truth, self.same, self.optimizer = truth, same, optimizer
        self.precision = precision
        self.kernels = kernels
        #: Why the truth is float32 (the float64 truth's error), or None while it is float64.
        self.fallback: str | None = None
        #: With a float32 truth: its bfloat16 copy, and each step's measured error of the truth's gradients
        #: (by parameter name) and losses (by replica).
        self.coarse: torch.nn.Module | None = None
        self.own_errors: dict[str, float] = {}
        self.own_loss_errors: list[float] = []
        #: The sharded run's routing, which the computing references replay (routing.py).
        self.replay = Replay()
        for role, model in (("truth", truth), ("same", same)):
            replay_under(model, self.replay, role)

    @classmethod
    def build(cls, ctx) -> References:
        base = _unsharded(ctx)
        truth = copy.deepcopy(base).double()
        kernels = Float64Kernels()
        run_forward_under(truth, kernels)
        same = copy.deepcopy(base)
        precision = emulate_mixed_precision(ctx, same)
        return cls(truth, same, base, precision, kernels)

    @property
    def truth_dtype(self) -> str:
        """The truth, in words (the check's `data["truth"]` and its message)."""
        if self.fallback is not None:
            return (
                f"float32 (float64 failed: {self.fallback}; its own error measured by a bfloat16 copy, "
                f"times eps(float32)/eps(bfloat16) = {COARSE_RATIO:.3g})"
            )
        replaced = ", ".join(f"{name} by float64 matmuls" for name in sorted(self.kernels.replaced))
        return f"float64 ({replaced})" if replaced else "float64"

    def _computing(self) -> list[torch.nn.Module]:
        return [m for m in (self.truth, self.same, self.coarse) if m is not None]

    def start_from(self, model, pp_group=None) -> list[str]:
        """Every reference's parameters := the sharded model's full parameters. A pipeline's stages are
        gathered from the ranks of `pp_group` first (each rank holds its own stages' parameters), and the
        members of experts split over ranks (a ModuleList's or ModuleDict's) from the ranks holding them.
        The unsharded model's parameters that no rank holds, if any (a split that lost a module)."""
        with torch.no_grad():
            whole = {name: full(p.detach()) for name, p in model.named_parameters()}
            gathered = lay.from_holders(whole, lambda v: v.cpu(), pp_group)
            whole = gathered if gathered is not None else whole
            for name, value in whole.items():
                for reference in (*self._computing(), self.optimizer):
                    target = reference.get_parameter(name)
                    target.copy_(value.to(target.device))
        if pp_group is None and gathered is None:
            return []
        return [name for name, _ in self.truth.named_parameters() if name not in whole]

    def forward_backward(self, ctx, full: list[tuple], microbatches: int = 1) -> tuple[list[float], list[float]]:
        """The computing references on every replica's inputs; each replica's loss, truth's then same's.
        With `microbatches`, a replica's loss is the mean of its microbatches' losses, as a pipeline's.
        A truth that fails in float64 becomes a float32 one, measured by a bfloat16 copy from then on."""
        own = self.replay.replica
        try:
            truth = _losses(ctx, self.truth, full, microbatches, replay=self.replay)
        except (RuntimeError, NotImplementedError) as error:
            if self.fallback is not None:
                raise
            self._fall_back(error)
            truth = _losses(ctx, self.truth, full, microbatches, replay=self.replay)
        same = _losses(ctx, self.same, full, microbatches, cast=False, replay=self.replay)
        unfinite = self.not_finite() if self.fallback is None else frozenset()
        if unfinite - not_finite_gradients(self.same):  # float64's own overflow (LED's masks)
            self._fall_back(FloatingPointError("gradients not finite where the same-precision reference's are"))
            truth = _losses(ctx, self.truth, full, microbatches, replay=self.replay)
        if self.coarse is not None:
            try:
                coarse = _losses(ctx, self.coarse, full, microbatches, replay=self.replay)
            except (RuntimeError, NotImplementedError) as error:
                raise TruthUnavailable(
                    f"the truth is float32 ({self.fallback}), and its {COARSE} copy, which measures its "
                    f"error, failed too ({type(error).__name__}: {str(error).strip()[:200]})"
                ) from error
            self.own_loss_errors = [abs(c - t) * COARSE_RATIO for c, t in zip(coarse, truth)]
            self.own_errors = {
                name: float((c.grad.double() - t.grad.double()).norm()) * COARSE_RATIO
                for (name, t), c in zip(self.truth.named_parameters(), self.coarse.parameters())
                if t.grad is not None and c.grad is not None
            }
        self.replay.replica = own  # a later rerun (localise) runs this rank's own replica
        return truth, same

    def _fall_back(self, error: BaseException) -> None:
        """The truth := the model in float32 (and its bfloat16 copy), from the optimizer copy's parameters,
        which are the truth's: every reference starts each step from the sharded model's."""
        self.fallback = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        self.truth = copy.deepcopy(self.optimizer).float()
        self.coarse = copy.deepcopy(self.optimizer).to(COARSE)
        replay_under(self.truth, self.replay, "truth")
        replay_under(self.coarse, self.replay, "coarse")

    def not_finite(self) -> frozenset[str]:
        """The parameters whose gradient the truth itself computed not finite this step (the unsharded model's
        own NaN: LED's and Longformer's attention over a padded window): nothing to compare them with."""
        return not_finite_gradients(self.truth)

    def own_error(self, name: str) -> float:
        """The truth's own measured error in the gradient of `name` this step (0 for the float64 truth)."""
        return self.own_errors.get(name, 0.0)

    def own_loss_error(self, replica: int) -> float:
        return self.own_loss_errors[replica] if self.own_loss_errors else 0.0

    def relative_rounding(self) -> float:
        """The same-precision reference's gradients' error relative to the truth's, over every gradient of
        the step (with the truth's own error): how far this precision puts a result from the truth,
        measured on many numbers."""
        error = size = 0.0
        for (name, t), s in zip(self.truth.named_parameters(), self.same.parameters()):
            if t.grad is not None and s.grad is not None and name not in self.not_finite():
                error += float((s.grad.double() - t.grad.double()).pow(2).sum()) + self.own_error(name) ** 2
                size += float(t.grad.double().pow(2).sum())
        return math.sqrt(error / size) if size else 0.0

    def gradient_scale(self) -> float:
        """The root-mean-square value of the truth's gradients this step."""
        unfinite = self.not_finite()
        grads = [p.grad for n, p in self.truth.named_parameters() if p.grad is not None and n not in unfinite]
        total = sum(g.numel() for g in grads)
        return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads) / total) if total else 0.0


def not_finite_gradients(model) -> frozenset[str]:
    """The parameters of `model` whose gradient holds a NaN or an infinity."""
    return frozenset(
        name for name, p in model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())
    )


class TruthUnavailable(Exception):
    """No truth whose error is known: float64 failed, and so did the copy that measures float32's error."""


def _losses(ctx, reference, full: list[tuple], microbatches: int, cast: bool = True, replay=None) -> list[float]:
    """Forward and backward of `reference` on every replica's inputs; each replica's loss. Each replica's
    share of the mean is a backward of its own, so its gradient is accumulated into `.grad` by itself, as
    each rank's gradient enters the reduction (the `reduce` hooks of emulate_mixed_precision round there).
    `cast`: floating inputs in the reference's own dtype (the truths); else as they are (the sharded model's).
    `replay` is told which replica runs, so that its routing is that replica's (routing.py)."""
    reference.zero_grad(set_to_none=True)
    losses = []
    for replica, x in enumerate(full):
        if replay is not None:
            replay.replica = replica
        loss = torch.stack(
            [
                lay.loss(ctx, reference(*inputs_for(reference, mb, cast)), mb).to(torch.float64)
                for mb in lay.microbatches(x, microbatches)
            ]
        ).mean()
        (loss / len(full)).backward()
        losses.append(float(loss.detach()))
    return losses


def inputs_for(reference, inputs: tuple, cast: bool = False) -> tuple:
    """The float64 truth takes float64 inputs; the others take them as they are, or with `cast` (the float32
    truth and its bfloat16 copy) in their parameters' dtype."""
    dtype = next((p.dtype for p in reference.parameters()), None)
    if dtype != torch.float64 and not (cast and dtype is not None):
        return inputs
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)


def emulate_mixed_precision(ctx, model) -> str:
    """Make `model` compute as the plan's fully_shard units do: parameter dtype per unit, inputs cast to it,
    outputs to `output`, and gradients reduced in `reduce` (each replica's gradient added to the sum so far
    and the sum rounded to `reduce`, as a reduction in that dtype rounds); the precision, in words."""
    from ..compiler.float32 import float32_units
    from ..compiler.predict import units_by_module

    resolution = ctx.applied.linted.resolution
    # Parameters the model keeps in float32, which the lowering gave float32 units of their own (their
    # gradients reduced in the outer unit's `reduce`, and their inputs not cast: as those units do).
    kept = float32_units(ctx.plan, resolution)
    float32 = {id(t) for k in kept for t in model.get_submodule(k.module).parameters()}
    computes, reduces = set(), {}
    # Parents first, so a child unit's own policy wins over its parent's, as FSDP applies them.
    for fqn, unit in sorted(units_by_module(resolution).items(), key=lambda item: item[0].count(".") + bool(item[0])):
        block = ctx.plan.units[unit.block]
        policy = unit.option(block, "mixed_precision") if unit.kind(block) == "fully_shard" else None
        if policy is None:
            continue
        module = model.get_submodule(fqn)
        if policy.param is not None:
            dtype = getattr(torch, policy.param.name)
            computes.add(dtype)
            for param in module.parameters():  # FSDP casts parameters, not buffers
                if id(param) not in float32:
                    param.data = param.data.to(dtype)
            if policy.cast_forward_inputs:
                module.register_forward_pre_hook(_cast_hook(dtype), with_kwargs=True)
        for param in module.parameters():
            # FSDP reduces in the compute dtype when `reduce` is not given, and computes it in that dtype.
            reduces[param] = getattr(torch, policy.reduce.name) if policy.reduce is not None else None
        if policy.output is not None:
            module.register_forward_hook(_cast_output(getattr(torch, policy.output.name)))
    coarser = {}
    for param, dtype in reduces.items():
        if dtype is not None and torch.finfo(dtype).eps > torch.finfo(param.dtype).eps:
            param.register_post_accumulate_grad_hook(_round_grad(dtype))
            coarser[dtype] = True
    found = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    words = "/".join(found) or "float32"
    if computes:
        words = f"mixed precision: {', '.join(sorted(str(d).removeprefix('torch.') for d in computes))} compute"
    if coarser:
        words += f", {', '.join(sorted(str(d).removeprefix('torch.') for d in coarser))} reduce"
    if kept:
        words += f"; {len(kept)} module{'s' if len(kept) > 1 else ''} kept in float32 ({kept[0].why()})"
    return words


def _round_grad(dtype):
    def hook(param):
        with torch.no_grad():
            param.grad.copy_(param.grad.to(dtype))

    return hook


def _cast(value, dtype):
    """Every floating-point tensor in `value` (inside tuples, lists, dicts: torch's pytree) as `dtype`."""
    return tree_map(lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, value)


def _cast_hook(dtype):
    def hook(module, args, kwargs):
        return _cast(args, dtype), _cast(kwargs, dtype)

    return hook


def _cast_output(dtype):
    def hook(module, args, output):
        return _cast(output, dtype)

    return hook


def _unsharded(ctx) -> torch.nn.Module:
    """The unsharded model on this rank, holding the sharded model's parameters and persistent buffers made
    whole, in the dtype of the sharded model's parameters."""
    torch.manual_seed(0)
    with torch.device(ctx.device):
        reference = ctx.model_file.build_model()
    copy_named_tensors(ctx.model, reference)
    return reference


def copy_named_tensors(sharded: torch.nn.Module, unsharded: torch.nn.Module) -> None:
    """Copy each parameter and persistent buffer of `sharded`, made whole by `full`, into the tensor of the
    same name in `unsharded`. By name, as `named_parameters()` and `named_buffers()` give them, not by
    `state_dict()` keys: a model's state-dict hooks may rename or split its tensors (torchtitan's fused QKV
    saves `wqkv` as `wq`, `wk`, `wv`), and torch's get_model_state_dict cannot map such keys back to
    parameters. Non-persistent buffers keep what the constructor computed, as a state dict leaves them.
    ValueError, before anything is copied, for a name the unsharded model lacks or another shape."""
    wanted = dict(unsharded.named_parameters(remove_duplicate=False))
    wanted.update(unsharded.named_buffers(remove_duplicate=False))
    pairs, unexpected = [], []
    for name, tensor in [*sharded.named_parameters(), *persistent_buffers(sharded)]:
        target = wanted.get(name)
        if target is None or tuple(target.shape) != tuple(tensor.shape):
            unexpected.append(
                name if target is None else f"{name} {tuple(tensor.shape)}, unsharded {tuple(target.shape)}"
            )
        else:
            pairs.append((target, tensor))
    if unexpected:
        raise ValueError(f"the sharded model has tensors the unsharded one lacks: {unexpected[:5]}")
    with torch.no_grad():
        for target, tensor in pairs:
            target.copy_(full(tensor.detach()).to(target.device))


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`model.named_buffers()` less the non-persistent ones (those a state dict leaves out)."""
    found = []
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                found.append((f"{module_name}.{name}" if module_name else name, buffer))
    return found


def shape_mismatch(ctx) -> str:
    """The parameters and buffers whose full shape differs from the unsharded model's (a shard that lost
    rows), in words; "" if none. The unsharded model is built on the meta device: no memory."""
    with torch.device("meta"):
        unsharded = ctx.model_file.build_model()
    want = {**dict(unsharded.named_parameters()), **dict(unsharded.named_buffers())}
    wrong = [
        f"{name} is {tuple(t.shape)}, unsharded {tuple(want[name].shape)}"
        for name, t in [*ctx.model.named_parameters(), *ctx.model.named_buffers()]
        if name in want and tuple(t.shape) != tuple(want[name].shape)
    ]
    return "; ".join(wrong[:5]) + (f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else "")
