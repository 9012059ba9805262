"""The gradients check's truth where kernels refuse float64: torch._grouped_mm computed in float64 by one
matmul per group (against torch's own kernel in float32, values and gradients), and the float32 truth
with its measured error where float64 fails for an op shardlang has no replacement for."""

import pytest
import torch

from shardlang.launch.job import Job, run
from shardlang.verification.truth import Float64Kernels, grouped_mm, run_forward_under

from .conftest import ROOT

OFFS = torch.tensor([3, 3, 8, 10], dtype=torch.int32)  # an empty group; rows 10 and 11 past the last end


def _layouts(generator):
    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    return {
        "2d x 3d (MoE forward)": (randn(12, 8), randn(4, 8, 4), OFFS),
        "3d x 2d": (randn(4, 4, 8), randn(8, 12), OFFS),
        "2d x 2d (MoE weight gradient)": (randn(4, 12), randn(12, 8), OFFS),
        "3d x 3d": (randn(4, 4, 8), randn(4, 8, 4), None),
    }


def _defined(layout: str, out, a_grad, b_grad, end: int):
    """What torch's kernel defines: rows (2d x 3d) or columns (3d x 2d) of the output past the last end,
    and the gradients of operand parts no group reads, are left undefined (shardlang's are zero)."""
    if layout.startswith("2d x 3d"):
        return out[:end], a_grad[:end], b_grad
    if layout.startswith("3d x 2d"):
        return out[:, :end], a_grad, b_grad[:, :end]
    if layout.startswith("2d x 2d"):
        return out, a_grad[:, :end], b_grad[:end]
    return out, a_grad, b_grad


@pytest.mark.parametrize("layout", sorted(_layouts(torch.Generator())))
def test_grouped_mm_in_float64_is_torchs_kernel_and_its_gradients(layout):
    a, b, offs = _layouts(torch.Generator().manual_seed(0))[layout]
    end = int(offs[-1]) if offs is not None else 0
    shape = torch._grouped_mm(a, b, offs=offs).shape
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    if layout.startswith("2d x 3d"):
        weight[end:] = 0
    elif layout.startswith("3d x 2d"):
        weight[:, end:] = 0
    results = []
    for dtype, op in ((torch.float32, torch._grouped_mm), (torch.float64, grouped_mm)):
        x, y = (t.detach().to(dtype).requires_grad_() for t in (a, b))
        out = op(x, y, offs=offs)
        (out.double() * weight).sum().backward()
        results.append(_defined(layout, out, x.grad, y.grad, end))
    assert all(t.dtype == torch.float64 for t in results[1])
    for ours, kernel in zip(results[1], results[0]):
        torch.testing.assert_close(ours, kernel.double(), rtol=1e-5, atol=1e-5)


def test_the_mode_replaces_grouped_mm_in_the_truths_forward_only():
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 8, 4))

        def forward(self, x):
            return torch._grouped_mm(x, self.w, offs=OFFS)

    truth = Experts().double()
    x = torch.randn(12, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="Double"):
        truth(x)  # torch's kernel refuses float64: the reason for the mode
    kernels = Float64Kernels()
    run_forward_under(truth, kernels)
    truth(x).sum().backward()  # the backward differentiates matmuls: no mode and no float64 kernel needed
    assert truth.w.grad.dtype == torch.float64 and kernels.replaced == {"torch._grouped_mm": 1}
    with pytest.raises(RuntimeError, match="Double"):
        torch._grouped_mm(x, truth.w, offs=OFFS)  # outside the truth's forward, torch is untouched


SEQ = """mesh world = cpu[tp=auto]
parallelize on world.tp {
    norm   : sequence_parallel
    mlp    : prepare_input(input=shard(1), desired=replicate)
    mlp.w1 : colwise
    mlp.w2 : rowwise(output=shard(1))
}
verify gradients(steps=2, input=shard(1), output=shard(1))
"""


@pytest.mark.distributed
def test_a_kernel_without_float64_gives_a_float32_truth_that_says_so(pools, tmp_path):
    import shardlang

    plan = tmp_path / "seq.sl"
    plan.write_text(SEQ)
    job = Job(str(plan), {}, str(ROOT / "tests/faults/no_float64.py"), None, shardlang.load(plan).checks)
    (result,) = pools(2).run(run, job)[0].checks
    assert result.status == "pass", result.message
    assert result.data["truth"].startswith("float32 (float64 failed: RuntimeError: fused_gelu")
    assert "truth float32" in result.message and "measured by a bfloat16 copy" in result.message


FSDP = """mesh world = cpu[dp=auto]
fully_shard on world.dp { each mlp.w1; each mlp.w2 }
verify gradients(steps=2)
"""


@pytest.mark.distributed
@pytest.mark.parametrize("fault", ["nan_float64", "nan_everywhere"])
def test_a_truth_not_finite_in_float64_falls_back_and_one_not_finite_anywhere_is_left_out(pools, tmp_path, fault):
    """LED and Longformer (the zoo): their float64 gradients are NaN where float32's are not."""
    import shardlang

    plan = tmp_path / "fsdp.sl"
    plan.write_text(FSDP)
    job = Job(str(plan), {}, str(ROOT / f"tests/faults/{fault}.py"), None, shardlang.load(plan).checks)
    (result,) = pools(2).run(run, job)[0].checks
    assert result.status == "pass", result.message
    assert result.data["truth"].startswith("float32 (float64 failed: FloatingPointError: gradients not finite")
    left_out = ["mlp.act.scale"] if fault == "nan_everywhere" else []
    assert result.data["not_compared"] == left_out
    # the NaN gradient makes its parameter NaN: the second step's loss is not finite, and the check stops
    assert (result.data["stopped"] or "").startswith("stopped at step 1") == (fault == "nan_everywhere")
    assert ("1 gradients not compared, the unsharded model's own not finite (mlp.act.scale)" in result.message) == (
        fault == "nan_everywhere"
    )
