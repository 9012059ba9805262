"""placements: every parameter's and buffer's mesh dims and placements equal the compiler's prediction
for the installed torch (predict.py). Tensors placed by a user style shardlang cannot see into are
reported as not predicted, and not counted as passing."""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..compiler.predict import PLAIN, Placed
from ..frontend import ir
from .outcome import FAIL, PASS, SKIPPED, Outcome

LISTED = 6


def actual(tensor) -> Placed:
    """What a tensor is: plain, or a DTensor's mesh dims and placements as plan values."""
    if not isinstance(tensor, DTensor):
        return PLAIN
    names = tuple(tensor.device_mesh.mesh_dim_names or ())
    return Placed("?", names, tuple(_placement(p, tensor.ndim) for p in tensor.placements))


def _placement(p, ndim: int):
    from ..runtime.torchcompat import strided_shard_class

    if isinstance(p, strided_shard_class()):
        return ir.StridedShard(p.dim % ndim if ndim else p.dim, p.split_factor)
    if isinstance(p, Shard):
        return ir.Shard(p.dim % ndim if ndim else p.dim)
    if isinstance(p, Replicate):
        return ir.Replicate()
    if isinstance(p, Partial):
        return ir.Partial()
    return p


def _normal(placed: Placed, ndim: int) -> Placed:
    """A prediction with negative shard dims counted from the end, as DTensor reports them."""
    fixed = tuple(ir.Shard(p.dim % ndim) if isinstance(p, ir.Shard) and ndim else p for p in placed.placements)
    return Placed(placed.mesh, placed.dims, fixed, placed.known)


def run(ctx, check) -> Outcome:
    predicted = ctx.applied.predictions
    seen, matched, unpredicted, wrong = set(), 0, [], []
    for name, tensor in [*ctx.model.named_parameters(), *ctx.model.named_buffers()]:
        if id(tensor) in seen or name not in predicted:
            continue
        seen.add(id(tensor))
        want = predicted[name]
        if not want.known:
            unpredicted.append(name)
            continue
        got = actual(tensor)
        want = _normal(want, tensor.ndim)
        if (got.mesh is None) != (want.mesh is None) or (
            got.mesh is not None and (got.dims, got.placements) != (want.dims, want.placements)
        ):
            wrong.append((name, want, got))
        else:
            matched += 1
    data = {
        "matched": matched,
        "unpredicted": unpredicted,
        "wrong": [{"name": n, "predicted": str(w), "actual": _show(g)} for n, w, g in wrong],
    }
    note = (
        f"; {len(unpredicted)} placed by user styles, not predicted: {', '.join(unpredicted[:LISTED])}"
        if unpredicted
        else ""
    )
    if wrong:
        listed = "; ".join(f"{n}: predicted {w}, got {_show(g)}" for n, w, g in wrong[:LISTED])
        return Outcome(FAIL, f"{len(wrong)} of {len(seen)} tensors differ from the prediction: {listed}{note}", data)
    if not matched:
        return Outcome(SKIPPED, f"nothing to check: no tensor has a prediction{note}", data)
    return Outcome(PASS, f"{matched} tensors placed as predicted{note}", data)


def _show(placed: Placed) -> str:
    if placed.mesh is None:
        return "plain tensor"
    from ..compiler.predict import _placement_text

    return f"[{', '.join(placed.dims)}] ({', '.join(_placement_text(p) for p in placed.placements)})"
