"""comms: the collectives of one forward and backward pass, counted with torch's CommDebugMode;
always reported, compared with the counts the plan gives (`comms(all_reduce=2, total=3)`).

Counted: the model's forward, the loss and the backward. Not counted: reassembling an output that
TP ranks hold in slices (`output=shard(D)`), which only the checks do."""

from __future__ import annotations

import warnings

from . import Outcome, layout as lay


def op_name(op) -> str:
    """`c10d_functional.all_reduce` -> `all_reduce`: torch's op name without its namespace."""
    return str(op).split(".")[-1] if "." in str(op) else str(op)


def count_collectives(ctx, model) -> dict[str, int]:
    """Collectives of one forward, loss and backward of `model`, with the inputs and loss the checks
    use for this plan (the reassembly of a sliced output is not counted: only the checks do it)."""
    from torch.distributed.tensor.debug import CommDebugMode

    gradients = next((c for c in ctx.plan.checks if c.name == "gradients"), None)
    input_layout = gradients.get("input") if gradients is not None else None
    output_layout = gradients.get("output") if gradients is not None else None
    where = lay.layout(ctx)
    full = lay.replica_inputs(ctx, -1, where.replica, 2 * max(where.tp_size, 1))
    inputs = lay.local_inputs(full, where, input_layout)
    forward, backward = CommDebugMode(), CommDebugMode()
    with warnings.catch_warnings():
        # CommDebugMode's module tracker warns about full backward hooks when inputs need no gradient.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        with forward:
            output = model(*inputs)
        whole = lay.full_output(ctx, where, output, output_layout)
        with backward, lay.loss_context(ctx.plan):
            lay.loss(ctx, whole, full).backward()
    model.zero_grad(set_to_none=True)
    counts: dict[str, int] = {}
    for mode in (forward, backward):
        for op, n in mode.get_comm_counts().items():
            counts[op_name(op)] = counts.get(op_name(op), 0) + n
    return dict(sorted(counts.items()))


def run(ctx, check) -> Outcome:
    if ctx.model_file.example_input is None:
        return Outcome(None, "not run: the model file defines no example_input(batch, generator)")
    counts = count_collectives(ctx, ctx.model)
    total = sum(counts.values())
    expected = dict(check.args)
    data = {"counts": counts, "total": total, "expected": expected}
    wrong = [f"{k}: expected {n}, counted {total if k == 'total' else counts.get(k, 0)}"
             for k, n in expected.items() if (total if k == "total" else counts.get(k, 0)) != n]  # fmt: skip
    shown = ", ".join(f"{k}={n}" for k, n in counts.items()) or "none"
    if wrong:
        return Outcome(False, f"{'; '.join(wrong)} (counted {shown})", data)
    verdict = "as expected" if expected else "not compared: the plan gives no counts"
    return Outcome(True, f"{total} collective{'' if total == 1 else 's'} ({shown}); {verdict}", data)
