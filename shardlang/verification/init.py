"""init: the sharded model starts where an unsharded model would (docs/checks.md).

Runs before anything trains. An unsharded model is built from the model file with the job's seed, as
`build_model()` returns it (initialised by the model's own code), and compared tensor by tensor, by name:
- `init cpu`, `init rank0`, `init auto`: every parameter's and buffer's full tensor is bitwise equal to
  the unsharded model's (they are built by the same code from the same random numbers).
- `init meta`: each shard draws its own random values, so equality is in distribution: each
  parameter's mean and variance are within Z standard errors of the unsharded tensor's (a constant
  tensor, such as a norm's ones, must be equal); a tensor of fewer than TESTED_FROM elements is too small
  for that test, and is only checked to be finite and of the unsharded tensor's scale; no two ranks hold
  identical shards of different parts of a tensor whose unsharded slices differ (an init that fills every
  shard alike); every buffer is bitwise equal, except that on
  a GPU mesh a floating buffer the initialiser recomputed there (a rotary table) may differ from the
  CPU-built one within torch.testing's tolerance for its dtype, which the pass message says.
Skipped when the weights were loaded from a checkpoint (they are not an initialisation).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from .outcome import FAIL, PASS, SKIPPED, Outcome
from .reference import full

#: Standard errors allowed between a sharded tensor's mean (or variance) and the unsharded one's: six
#: keeps the chance of a false alarm below one in a hundred million per comparison.
Z = 6.0
LISTED = 6

#: Fewer elements than this are too small to test in distribution. The standard errors are estimated from
#: the tensors themselves, and from a few draws they are so rough that six of them are not a safe bound (of
#: two 4-element samples of one distribution, 0.2% have means and 1% variances more than six estimated
#: standard errors apart; from 64 elements the tails are the normal's), and no bound there has power: a
#: standard deviation twice the unsharded one is found in under 1% of 64-element tensors, half of 128-element
#: ones, all of 256-element ones.
TESTED_FROM = 64

#: The chance that a tensor of one distribution falls outside the scale bound on either side, for each of
#: the sharded and the unsharded tensor.
SCALE_FALSE_ALARM = 1e-9


def run(ctx, check) -> Outcome:
    if ctx.checkpoint is not None:
        return Outcome(SKIPPED, f"not run: the weights were loaded from {ctx.checkpoint.path}, not initialised")
    mode = ctx.plan.init.mode
    reference = _unsharded(ctx, mode)
    tensors, seen = [], set()
    for kind, named in (("parameter", ctx.model.named_parameters()), ("buffer", ctx.model.named_buffers())):
        for name, tensor in named:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append((kind, name, tensor))
    wrong: list[str] = []
    small: list[str] = []  # parameters too small to test in distribution: finite and of the right scale only
    recomputed: list[str] = []  # buffers an initialiser recomputed on the mesh device: equal within its rounding
    duplicated = _duplicated_shards(tensors, reference) if mode == "meta" else []
    for kind, name, tensor in tensors:
        got = full(tensor.detach())
        want = reference.get_parameter(name) if kind == "parameter" else reference.get_buffer(name)
        got, want = got.cpu(), want.detach().cpu()
        if got.shape != want.shape or got.dtype != want.dtype:
            wrong.append(f"{name}: {tuple(got.shape)} {_dtype(got)}, unsharded {tuple(want.shape)} {_dtype(want)}")
        elif mode == "meta" and kind == "buffer" and ctx.device.type != "cpu" and _within_rounding(got, want):
            if not torch.equal(got, want):
                recomputed.append(name)
        elif mode != "meta" or kind == "buffer" or _constant(want):
            if not torch.equal(got, want):
                wrong.append(f"{name}: not bitwise equal to the unsharded {kind}{_max_difference(got, want)}")
        else:
            if got.numel() < TESTED_FROM:
                small.append(name)
            problem = _distribution(got, want)
            if problem:
                wrong.append(f"{name}: {problem}")
    wrong += duplicated
    how = "in distribution (parameters) and bitwise (buffers)" if mode == "meta" else "bitwise"
    if recomputed:
        how += (
            f", but {len(recomputed)} buffer{'s' if len(recomputed) > 1 else ''} recomputed on {ctx.device.type} by "
            f"the initialiser, equal to the CPU's within torch.testing's rounding for the dtype "
            f"({', '.join(recomputed[:3])}{', ...' if len(recomputed) > 3 else ''})"
        )
    if small:
        how += (
            f"; {len(small)} parameter{'s' if len(small) > 1 else ''} of fewer than {TESTED_FROM} elements too small "
            f"to test in distribution, only finite and of the unsharded scale ({', '.join(small[:3])}"
            f"{', ...' if len(small) > 3 else ''})"
        )
    data = {"init": mode, "compared": len(tensors), "how": how, "wrong": wrong[:20], "too_small": small[:20]}
    if wrong:
        more = f" (and {len(wrong) - LISTED} more)" if len(wrong) > LISTED else ""
        why = _why_meta(ctx.plan.init.method, ctx.model) if mode == "meta" and len(wrong) > len(duplicated) else ""
        return Outcome(FAIL, f"`init {mode}`: " + "; ".join(wrong[:LISTED]) + more + why, data)
    if not tensors:
        return Outcome(SKIPPED, "nothing compared: the model has no parameters or buffers", data)
    return Outcome(PASS, f"`init {mode}`: {len(tensors)} tensors match an unsharded model's, {how}", data)


def _unsharded(ctx, mode: str) -> torch.nn.Module:
    """What `build_model()` returns with the job's seed, built where the sharded model was built (the same
    random generator): the model as its own code initialises it. Under `init meta` the sharded model was
    initialised by shardlang's calls instead (compiler.initialisers), so comparing with a model that they
    re-initialised would pass an `init meta` that discards the model's own initialisation."""
    device = ctx.device if mode == "auto" else torch.device("cpu")
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(ctx.seed)
        with torch.device(device):
            return ctx.model_file.build_model()


#: Names under which models commonly keep the function that initialises their whole tree.
WHOLE_MODEL_INITIALISERS = ("init_weights", "init_states", "initialize_weights", "init_parameters")


def _why_meta(method: str | None, model) -> str:
    """The likely causes of `init meta` values unlike build_model()'s, in words."""
    if method is None:
        found = [n for n in WHOLE_MODEL_INITIALISERS if callable(getattr(type(model), n, None))]
        name = " or ".join(f"`init meta with {n}`" for n in found) or "`init meta with METHOD`"
        return (
            ". `init meta` initialises each module its own way (reset_parameters, a transformers model's "
            "_init_weights), which is not how build_model() initialised these: if build_model() initialises the "
            f"model with a function of its own, name it ({name}); else an initialiser reads a shard's local "
            "shape (its fan-in)"
        )
    return (
        f". `init meta with {method}` does not initialise these as build_model() does (is {method} the function "
        "build_model() calls?), or an initialiser reads a shard's local shape (its fan-in)"
    )


def _within_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether a floating buffer is equal to the unsharded one within torch.testing's default tolerance for
    its dtype: under `init meta` an initialiser may recompute a buffer on the mesh device (a rotary table's
    cos and sin on the GPU), where the unsharded model computed it on the CPU, a few units in the last
    place apart."""
    if not (got.is_floating_point() or got.is_complex()):
        return False
    try:
        torch.testing.assert_close(got, want)
    except AssertionError:
        return False
    return True


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _constant(tensor: torch.Tensor) -> bool:
    return tensor.numel() <= 1 or bool((tensor == tensor.flatten()[0]).all())


def _max_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    if not got.is_floating_point():
        return ""
    return f" (max difference {float((got.double() - want.double()).abs().max()):.3g})"


def _distribution(got: torch.Tensor, want: torch.Tensor) -> str:
    """Why `got` is not drawn like `want` (mean and variance beyond Z standard errors; for a tensor too small
    to test, its scale beyond a safe bound), or ""."""
    g, w = got.double().flatten(), want.double().flatten()
    n = g.numel()
    if not bool(torch.isfinite(g).all()):
        return "not finite"
    if n < TESTED_FROM:
        return _scale(g, w)
    mg, mw, vg, vw = float(g.mean()), float(w.mean()), float(g.var(unbiased=False)), float(w.var(unbiased=False))
    mean_se = math.sqrt((vg + vw) / n)
    if abs(mg - mw) > Z * mean_se:
        return f"mean {mg:.4g}, unsharded {mw:.4g} (more than {Z:g} standard errors, {mean_se:.2g}, apart)"
    # The variance's standard error from the fourth central moment: no assumption of normality.
    var_se = math.sqrt((float(((g - mg) ** 4).mean()) - vg**2) / n + (float(((w - mw) ** 4).mean()) - vw**2) / n)
    if abs(vg - vw) > Z * var_se:
        return (
            f"standard deviation {math.sqrt(vg):.4g}, unsharded {math.sqrt(vw):.4g} (variances more than {Z:g} "
            f"standard errors apart)"
        )
    return ""


def _scale(g: torch.Tensor, w: torch.Tensor) -> str:
    """Why `g` is not of `w`'s scale, or "": their root mean squares further apart than two samples of
    `g.numel()` draws of one distribution come (an uninitialised or zeroed tensor, a scale a thousand times
    off). The bound is safe rather than sharp: what each root mean square of n normal draws stays within,
    around the distribution's, but with chance SCALE_FALSE_ALARM (Chernoff's bound on a chi-square)."""
    low, high = _rms_bounds(g.numel())
    rg, rw = float(g.square().mean().sqrt()), float(w.square().mean().sqrt())
    if low * rg <= high * rw and low * rw <= high * rg:
        return ""
    return (
        f"root mean square {rg:.4g}, unsharded {rw:.4g} (more than {high / low:.3g} times apart, which {g.numel()} "
        f"draws of one distribution are not; too small to test its distribution)"
    )


def _rms_bounds(n: int) -> tuple[float, float]:
    """(low, high): the root mean square of n normal draws of standard deviation 1 is below `low`, and
    above `high`, each with chance under SCALE_FALSE_ALARM. Chernoff: P(chi2_n / n <= t) and, for t > 1,
    P(chi2_n / n >= t) are at most (t e^(1 - t))^(n/2); each t solves log t + 1 - t = 2 log(alarm) / n."""
    target = 2 * math.log(SCALE_FALSE_ALARM) / n

    def solve(lo: float, hi: float, rising: bool) -> float:
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            if (math.log(mid) + 1 - mid < target) == rising:
                lo = mid
            else:
                hi = mid
        return math.sqrt(math.sqrt(lo * hi))

    return solve(1e-300, 1.0, True), solve(1.0, 1e6, False)


def _duplicated_shards(tensors, reference) -> list[str]:
    """Tensors of which two ranks hold identical shards of different parts where the unsharded tensor's
    slices for those parts differ (an init that fills every shard alike). Shards that equal each other where
    the unsharded slices do too are right: Jamba's `A_log` repeats one row by construction, and its shards of
    different rows are equal. One all_gather_object of small fingerprints: each rank's shard's, and the
    unsharded tensor's slice that the rank holds (sliced by the same placements, without communication)."""
    mine = {}
    for kind, name, tensor in tensors:
        if kind != "parameter" or not isinstance(tensor, DTensor):
            continue
        sharded_dims = [i for i, p in enumerate(tensor.placements) if p.is_shard()]
        if not sharded_dims:
            continue
        want = reference.get_parameter(name).detach()
        if _constant(want):
            continue
        expected = distribute_tensor(want, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
        coordinate = tensor.device_mesh.get_coordinate() or []
        where = tuple(coordinate[i] for i in sharded_dims)
        mine[name] = (where, _fingerprint(tensor.to_local()), _fingerprint(expected))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [found for name in mine if (found := _alike(name, everyone))]


def _fingerprint(local: torch.Tensor) -> tuple:
    """A shard's shape, sum, sum of squares and largest magnitude: equal for equal shards."""
    local = local.detach().double()
    largest = float(local.abs().max()) if local.numel() else 0.0
    return tuple(local.shape), float(local.sum()), float((local * local).sum()), largest


def _alike(name: str, everyone: list) -> str:
    """The first two ranks holding identical shards of different parts of `name` whose unsharded slices differ
    ("" if none)."""
    by_print: dict = {}
    for rank, theirs in enumerate(everyone):
        if name not in theirs or math.prod(theirs[name][1][0]) <= 1:
            continue
        where, fingerprint, expected = theirs[name]
        for other, other_where, other_expected in by_print.setdefault(fingerprint, []):
            if other_where != where and other_expected != expected:
                return f"{name}: ranks {other} and {rank} hold identical shards of different parts"
        by_print[fingerprint].append((rank, where, expected))
    return ""
