"""The gradients check's truth in float64, through kernels that have no float64 version (docs/checks.md).

Some kernels refuse float64: `torch._grouped_mm`, which transformers 5 runs mixture-of-experts layers
with by default, takes only float32, bfloat16 and float16. While the truth runs forward, a
TorchFunctionMode replaces each such call with a float64 computation of the same function built from
differentiable ops (`grouped_mm`: one matmul per group). Autograd then differentiates those ops, so
the backward needs no mode and no float64 kernel either: the truth can be called anywhere (the
localising rerun included) and stays float64 all through. The mode is active only inside the truth's
own forward, so the sharded model never runs under it.

An op that still refuses float64 (one not in KERNELS, or one that fails only in backward) makes the
caller fall back to a float32 truth whose own error is measured (reference.py).
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode


def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """`torch._grouped_mm(mat_a, mat_b, offs=offs, bias=bias)` as one matmul per group, in the operands'
    dtype (float64 for the truth), differentiable by autograd's ordinary rules. `out_dtype` is not applied:
    it asks a low-precision kernel to accumulate more precisely, and float64 already does.

    The four layouts of the op (offs holds each group's end along the dim it splits; rows or columns
    past the last end are zero, where the kernel leaves them undefined):

    >>> a, b, offs = torch.arange(12.0).reshape(3, 4), torch.ones(2, 4, 2), torch.tensor([1, 3])
    >>> grouped_mm(a, b, offs).tolist()  # 2-D x 3-D: rows of a split by offs, group g times b[g]
    [[6.0, 6.0], [22.0, 22.0], [38.0, 38.0]]
    >>> grouped_mm(torch.ones(2, 2, 3), torch.ones(3, 4), torch.tensor([1, 4])).shape  # columns of b split
    torch.Size([2, 4])
    >>> grouped_mm(torch.ones(2, 4), torch.ones(4, 3), torch.tensor([1, 4])).tolist()[1]  # K split: one matrix per group
    [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
    >>> grouped_mm(torch.ones(2, 2, 3), torch.ones(2, 3, 1)).shape  # 3-D x 3-D: a batched matmul
    torch.Size([2, 2, 1])
    """
    ends = [int(e) for e in offs.tolist()] if offs is not None else []
    spans = list(zip([0, *ends[:-1]], ends))

    def plus_bias(out, g):
        if bias is None:
            return out
        return out + (bias[g] if bias.dim() > 1 else bias)

    if mat_a.dim() == 3 and mat_b.dim() == 3:
        return torch.stack([plus_bias(mat_a[g] @ mat_b[g], g) for g in range(mat_a.size(0))])
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        rows = [plus_bias(mat_a[s:e] @ mat_b[g], g) for g, (s, e) in enumerate(spans)]
        rows.append(mat_a.new_zeros(mat_a.size(0) - (ends[-1] if ends else 0), mat_b.size(-1)))
        return torch.cat(rows, dim=0)
    if mat_a.dim() == 3 and mat_b.dim() == 2:
        cols = [plus_bias(mat_a[g] @ mat_b[:, s:e], g) for g, (s, e) in enumerate(spans)]
        cols.append(mat_a.new_zeros(mat_a.size(1), mat_b.size(1) - (ends[-1] if ends else 0)))
        return torch.cat(cols, dim=1)
    return torch.stack([plus_bias(mat_a[:, s:e] @ mat_b[s:e], g) for g, (s, e) in enumerate(spans)])


#: Kernels without a float64 version, and the float64 computation that replaces each in the truth.
KERNELS = {
    torch._grouped_mm: grouped_mm,
    torch.ops.aten._grouped_mm: grouped_mm,
    torch.ops.aten._grouped_mm.default: grouped_mm,
}


def kernel_name(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    return f"torch.{name.split('.')[0]}"


class Float64Kernels(TorchFunctionMode):
    """While active, every KERNELS call on a float64 tensor is computed by its float64 replacement; what was
    replaced is counted in `replaced` (the check's report says so)."""

    def __init__(self):
        super().__init__()
        self.replaced: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        replacement = KERNELS.get(func)
        if replacement is not None and _any_float64(args, kwargs):
            self.replaced[kernel_name(func)] += 1
            return replacement(*args, **kwargs)
        return func(*args, **kwargs)


def _any_float64(args, kwargs) -> bool:
    return any(isinstance(x, torch.Tensor) and x.dtype == torch.float64 for x in (*args, *kwargs.values()))


def run_forward_under(model: torch.nn.Module, mode: Float64Kernels) -> None:
    """Every call of `model` (its root forward) runs under `mode`, whoever calls it; hooks run as before."""
    forward = model.forward

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        with mode:
            return forward(*args, **kwargs)

    model.forward = wrapped
