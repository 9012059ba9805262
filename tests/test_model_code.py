"""Verdicts on model code shardlang has never seen (issue 23): models whose state-dict hooks rename their
tensors (torchtitan's fused QKV), models that initialise themselves with their own function, recursive
initialisers under `init meta with METHOD`, and tied weights under `init rank0`. Runs `shardlang apply`'s
job on the test worker pools."""

import pytest

import shardlang
from shardlang.launch.job import Job, run

from .conftest import ROOT


def apply(pools, tmp_path, world: int, text: str, model: str, **job):
    path = tmp_path / "plan.sl"
    path.write_text(text)
    model = model if model.startswith("/") else str(ROOT / model)
    checks = shardlang.load(path).checks
    return pools(world).run(run, Job(str(path), {}, model, None, checks, explicit=True, **job))[0]


def statuses(report) -> dict:
    return {c.check: (c.status, c.message) for c in report.checks}


def assert_all_pass(report):
    assert report.ok and all(c.status == "pass" for c in report.checks), statuses(report)


# --- tied weights under init rank0 ------------------------------------------------------------------

TIED_RANK0 = {
    # rank 0 moved its model to meta with `model.to`, which unties an embedding shared with the output
    # layer: FSDP then sharded three parameters on rank 0 and two elsewhere, and gloo aborted the worker
    "fsdp": (2, "mesh world = cpu[dp=auto]\nfully_shard on world.dp { }\n"),
    "hsdp": (4, "mesh world = cpu[rep=2, shard=2]\nfully_shard on world[rep, shard] { }\n"),
    "tp-fsdp": (
        4,
        "mesh world = cpu[dp=2, tp=2]\nparallelize on world.tp { embedding : colwise; fc : rowwise }\n"
        "fully_shard on world.dp { }\n",
    ),
}


@pytest.mark.parametrize("case", sorted(TIED_RANK0))
def test_tied_weights_under_init_rank0(pools, tmp_path, case):
    world, plan = TIED_RANK0[case]
    text = plan + "init rank0\nverify init, init_device, placements, gradients(steps=1)\n"
    assert_all_pass(apply(pools, tmp_path, world, text, "examples/tied.py"))
