"""placements: every parameter's and buffer's mesh dims and placements equal the compiler's prediction
for the installed torch (predict.py): the table of built-in styles, and for a `use` style what it did
when apply ran it on a meta copy of its module in a simulated world. Tensors without a prediction (a
style that could not be run there) are reported as not predicted, and not counted as passing."""

from __future__ import annotations

from collections import defaultdict

from ..compiler.predict import Placed, placement_text
from ..frontend import ir
from ..runtime.simulated import placed_as
from .outcome import FAIL, PASS, SKIPPED, Outcome

LISTED = 6


def _normal(placed: Placed, ndim: int) -> Placed:
    """A prediction with negative shard dims counted from the end, as DTensor reports them."""
    fixed = tuple(ir.Shard(p.dim % ndim) if isinstance(p, ir.Shard) and ndim else p for p in placed.placements)
    return Placed(placed.mesh, placed.dims, fixed, placed.known, placed.note)


def run(ctx, check) -> Outcome:
    predicted = ctx.applied.predictions
    seen, matched, unpredicted, wrong = set(), 0, [], []
    present = dict([*ctx.model.named_parameters(), *ctx.model.named_buffers()])
    elsewhere = 0  # experts' members that another rank holds, as predicted
    for name, want in predicted.items():
        if want.held is None:
            continue
        if (name in present) != _holds(ctx, want.held):
            got = "held here" if name in present else "held elsewhere"
            wrong.append({"name": name, "predicted": _held_text(ctx, want.held), "actual": got, "how": ""})
        elif name not in present:
            elsewhere += 1
    for name, tensor in present.items():
        if id(tensor) in seen or name not in predicted:
            continue
        seen.add(id(tensor))
        want = predicted[name]
        if not want.known:
            unpredicted.append((name, want))
            continue
        got = placed_as(tensor)
        want = _normal(want, tensor.ndim)
        if (got.mesh is None) != (want.mesh is None) or (
            got.mesh is not None and (got.dims, got.placements) != (want.dims, want.placements)
        ):
            wrong.append({"name": name, "predicted": str(want), "actual": _show(got), "how": want.note})
        else:
            matched += 1
    data = {
        "matched": matched,
        "unpredicted": [n for n, _ in unpredicted],
        "wrong": wrong,
    }
    note = _not_predicted(unpredicted)
    if wrong:
        listed = "; ".join(f"{w['name']}: predicted {_how(w)}, got {w['actual']}" for w in wrong[:LISTED])
        return Outcome(FAIL, f"{len(wrong)} of {len(seen)} tensors differ from the prediction: {listed}{note}", data)
    if not matched:
        return Outcome(SKIPPED, f"nothing to check: no tensor has a prediction{note}", data)
    compared = f"{matched} of {len(seen)}" if unpredicted else f"{matched}"
    held = f"; {elsewhere} tensors of experts' members held by other ranks, as predicted" if elsewhere else ""
    return Outcome(PASS, f"{compared} tensors placed as predicted{held}{note}", data)


def _not_predicted(unpredicted: list[tuple[str, Placed]]) -> str:
    """'; N not predicted (why): names', one part per reason."""
    by_reason: dict[str, list[str]] = defaultdict(list)
    for name, placed in unpredicted:
        by_reason[placed.note or "no prediction"].append(name)
    parts = [
        f"; {len(names)} not predicted ({why}): {', '.join(names[:LISTED])}{', ...' if len(names) > LISTED else ''}"
        for why, names in by_reason.items()
    ]
    return "".join(parts)


def _holds(ctx, held: tuple[str, str, int, int]) -> bool:
    """Whether this rank holds the expert member that `held` describes (Placed.held)."""
    mesh, dim, index, members = held
    device_mesh = ctx.applied.meshes[mesh]
    size = device_mesh.size(device_mesh.mesh_dim_names.index(dim))
    return device_mesh.get_local_rank(dim) == index // (members // size)


def _held_text(ctx, held: tuple[str, str, int, int]) -> str:
    mesh, dim, index, members = held
    mine = "here" if _holds(ctx, held) else "elsewhere"
    return f"held {mine} (expert {index} of {members}, split over {mesh}.{dim})"


def _how(wrong: dict) -> str:
    """A misplaced tensor's prediction, with how it was predicted when the table of styles did not."""
    return f"{wrong['predicted']} ({wrong['how']})" if wrong["how"] else wrong["predicted"]


def _show(placed: Placed) -> str:
    if placed.mesh is None:
        return "plain tensor"
    return f"[{', '.join(placed.dims)}] ({', '.join(placement_text(p) for p in placed.placements)})"
