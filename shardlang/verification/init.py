"""init: the sharded model starts where an unsharded model would (docs/checks.md).

Runs before anything trains. An unsharded model is built from the model file with the job's seed, as
`build_model()` returns it (initialised by the model's own code), and compared tensor by tensor, by name:
- `init cpu`, `init rank0`, `init auto`: every parameter's and buffer's full tensor is bitwise equal to
  the unsharded model's (they are built by the same code from the same random numbers).
- `init meta`: each shard draws its own random values, so equality is in distribution: each
  parameter's mean and variance are within Z standard errors of the unsharded tensor's (a constant
  tensor, such as a norm's ones, must be equal); no two ranks hold identical shards of a tensor that
  is not constant (an init that fills every shard alike); every buffer is bitwise equal, except that on
  a GPU mesh a floating buffer the initialiser recomputed there (a rotary table) may differ from the
  CPU-built one within torch.testing's tolerance for its dtype, which the pass message says.
Skipped when the weights were loaded from a checkpoint (they are not an initialisation).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .outcome import FAIL, PASS, SKIPPED, Outcome
from .reference import full

#: Standard errors allowed between a sharded tensor's mean (or variance) and the unsharded one's: six
#: keeps the chance of a false alarm below one in a hundred million per comparison.
Z = 6.0
LISTED = 6


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
    data = {"init": mode, "compared": len(tensors), "how": how, "wrong": wrong[:20]}
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
    """Why `got` is not drawn like `want` (mean and variance beyond Z standard errors), or ""."""
    g, w = got.double().flatten(), want.double().flatten()
    n = g.numel()
    if not bool(torch.isfinite(g).all()):
        return "not finite"
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


def _duplicated_shards(tensors, reference) -> list[str]:
    """Tensors of which two ranks hold identical shards although they hold different parts of it and
    the unsharded tensor is not constant. One all_gather_object of small fingerprints."""
    mine = {}
    for kind, name, tensor in tensors:
        if kind != "parameter" or not isinstance(tensor, DTensor):
            continue
        sharded_dims = [i for i, p in enumerate(tensor.placements) if p.is_shard()]
        if not sharded_dims:
            continue
        local = tensor.to_local().detach().double()
        coordinate = tensor.device_mesh.get_coordinate() or []
        largest = float(local.abs().max()) if local.numel() else 0.0
        fingerprint = (tuple(local.shape), float(local.sum()), float((local * local).sum()), largest)
        mine[name] = (tuple(coordinate[i] for i in sharded_dims), fingerprint)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    found = []
    for name in mine:
        if _constant(reference.get_parameter(name).detach()):
            continue
        by_print: dict = {}
        for rank, theirs in enumerate(everyone):
            if name not in theirs or math.prod(theirs[name][1][0]) <= 1:
                continue
            where, fingerprint = theirs[name]
            other = by_print.setdefault(fingerprint, (rank, where))
            if other[1] != where:
                found.append(f"{name}: ranks {other[0]} and {rank} hold identical shards of different parts")
                break
    return found
