"""The gradients check on parameters of every rank a model zoo has (issue 39 class 0): a Conv2d's weight is
4-D, a Conv3d's 5-D, and the slice-by-slice comparison once took a matrix norm over three dims and raised on
each. transformers' ViT (its patch embedding is a Conv2d) under FSDP and TP x FSDP, with SGD and Adam,
beside a planted fault on that patch embedding that must fail naming it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from shardlang.launch.job import Job, run
from shardlang.verification.reference import worst_slice

from .conftest import ROOT

FAMILIES = ROOT / "tests" / "fixtures" / "families"
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs pip install -e '.[hf]'")


@pytest.mark.parametrize("shape", [(16,), (16, 8), (16, 3, 4, 4), (8, 2, 3, 4, 4)], ids=lambda s: f"{len(s)}-D")
def test_worst_slice_finds_the_one_wrong_slice_at_every_rank(shape):
    generator = torch.Generator().manual_seed(0)
    truth = torch.randn(shape, generator=generator, dtype=torch.float64)
    same = truth + 1e-7 * torch.randn(shape, generator=generator, dtype=torch.float64)
    right = torch.zeros(shape, dtype=torch.float64)
    assert worst_slice(right, truth, same, 1.0) is None or worst_slice(right, truth, same, 1.0).ratio < 1.0
    if len(shape) < 2:
        return
    wrong = right.clone()
    wrong[3] += 1e-3 * truth[3].abs().max()
    found = worst_slice(wrong, truth, same, 1.0)
    assert found.ratio > 1.0
    if found.dim == 0:  # where the worst is along the faulty dim, it is the faulty slice alone
        assert found.index == 3 and found.over == (3,)


def _apply(pools, plan: str, model: str, world: int):
    plan_path = FAMILIES / plan
    import shardlang

    job = Job(str(plan_path), {}, str(ROOT / model), None, shardlang.load(plan_path).checks)
    return pools(world).run(run, job)[0]


@needs_hf
@pytest.mark.distributed
@pytest.mark.parametrize(
    "plan, world", [("vit_fsdp_adam.sl", 2), ("vit_tp_fsdp_sgd.sl", 4)], ids=["fsdp-adam", "tp-fsdp-sgd"]
)
def test_vit_with_its_conv2d_passes_the_gradients_check(pools, plan, world):
    report = _apply(pools, plan, "examples/families/vit.py", world)
    assert report.ok, [(c.check, c.status, c.message) for c in report.checks]
    assert any(c.check == "gradients" and c.status == "pass" for c in report.checks)


@needs_hf
@pytest.mark.distributed
def test_a_fault_on_vits_patch_embedding_fails_naming_it(pools):
    report = _apply(pools, "vit_patch_unit.sl", "tests/faults/vit_patch_scaled.py", 2)
    failed = [c for c in report.checks if c.status == "fail"]
    assert failed and failed[0].check == "gradients", [(c.check, c.status, c.message) for c in report.checks]
    assert failed[0].data["localised"]["module"] == "vit.embeddings", failed[0].data.get("localised")
