"""Planted faults: each check must report its fault as failed, with a useful message, and pass once the
fault is fixed. Runs `shardlang apply`'s job on the test worker pools."""

import pytest

from shardlang.frontend.schema import CHECKS
from shardlang.launch.job import Job, run

FAULTS = {
    # name: (world, model, check, faulty plan, fixed plan, words the failure message must contain)
    "buffer differs across data-parallel ranks": (
        2,
        "tests/faults/rank_buffer.py",
        "module_states",
        "mesh world = cpu[dp=auto]\nfully_shard on world.dp { }\nverify module_states\n",
        "mesh world = cpu[dp=auto]\nfully_shard on world.dp { }\nsync over world.dp\nverify module_states\n",
        ["steps", "world.dp", "max difference 1"],
    ),
    "a use style wrong on one rank": (
        2,
        "examples/mlp.py",
        "gradients",
        "use tests.faults.styles.colwise_off_on_rank1 as odd\nmesh world = cpu[tp=auto]\n"
        "parallelize on world.tp { net1 : odd; net2 : rowwise }\nverify gradients(steps=1)\n",
        "use tests.faults.styles.colwise as odd\nmesh world = cpu[tp=auto]\n"
        "parallelize on world.tp { net1 : odd; net2 : rowwise }\nverify gradients(steps=1)\n",
        ["loss", "step 0"],
    ),
    "a parameter left on meta": (
        2,
        "examples/mlp.py",
        "init_device",
        "use tests.faults.styles.colwise_bias_on_meta as meta_bias\nmesh world = cpu[tp=auto]\n"
        "parallelize on world.tp { net1 : meta_bias; net2 : rowwise }\nverify init_device\n",
        "use tests.faults.styles.colwise as meta_bias\nmesh world = cpu[tp=auto]\n"
        "parallelize on world.tp { net1 : meta_bias; net2 : rowwise }\nverify init_device\n",
        ["net1.bias (meta)", "still on meta"],
    ),
    "a style placing tensors other than predicted": (
        2,
        "tests/faults/seq_norm.py",
        "placements",
        "use tests.faults.styles.ShardingSequenceParallel as sp\nmesh world = cpu[tp=auto]\n"
        "parallelize on world.tp { norm : sp; mlp.w1 : colwise; mlp.w2 : rowwise }\nverify placements\n",
        "use tests.faults.styles.PlainSequenceParallel as sp\nmesh world = cpu[tp=auto]\n"
        "parallelize on world.tp { norm : sp; mlp.w1 : colwise; mlp.w2 : rowwise }\nverify placements\n",
        ["norm.weight", "predicted world[tp] (Replicate())", "(Shard(0))"],
    ),
    "a wrong collective count": (
        2,
        "examples/mlp.py",
        "comms",
        "mesh world = cpu[tp=auto]\nparallelize on world.tp { net1 : colwise; net2 : rowwise }\nverify comms(all_reduce=5)\n",
        "mesh world = cpu[tp=auto]\nparallelize on world.tp { net1 : colwise; net2 : rowwise }\nverify comms(all_reduce=1)\n",
        ["all_reduce: expected 5, counted 1"],
    ),
}


def _job(tmp_path, name: str, text: str, model: str) -> Job:
    import shardlang

    from .conftest import ROOT

    path = tmp_path / f"{name}.sl"
    path.write_text(text)
    return Job(str(path), {}, str(ROOT / model), None, shardlang.load(path).checks)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_planted_fault_fails_its_check_and_the_fix_passes(pools, tmp_path, fault):
    world, model, check, faulty, fixed, words = FAULTS[fault]
    assert check in CHECKS
    report = pools(world).run(run, _job(tmp_path, "faulty", faulty, model))[0]
    (result,) = report.checks
    assert result.check == check and result.ok is False, result
    for word in words:
        assert word in result.message, f"{word!r} not in {result.message!r}"
    assert [d.code for d in report.diagnostics if d.is_error] == ["SL400"]
    report = pools(world).run(run, _job(tmp_path, "fixed", fixed, model))[0]
    (result,) = report.checks
    assert result.ok is True, result.message
    assert report.ok


def test_every_check_is_covered_by_a_fault():
    assert {f[2] for f in FAULTS.values()} == {"module_states", "gradients", "init_device", "placements", "comms"}
    assert set(CHECKS) == {f[2] for f in FAULTS.values()}


def test_check_without_example_input_is_not_run_and_not_passed(pools, tmp_path):
    (tmp_path / "noinput.py").write_text("from examples.mlp import build_model\n")
    job = _job(
        tmp_path,
        "noinput",
        "mesh world = cpu[tp=auto]\nparallelize on world.tp { net1 : colwise; net2 : rowwise }\n",
        str(tmp_path / "noinput.py"),
    )
    assert [c.name for c in job.checks] == ["gradients", "module_states", "init_device", "placements", "comms"]
    report = pools(2).run(run, job)[0]
    skipped = {c.check for c in report.skipped}
    assert skipped == {"gradients", "comms"}
    assert all(c.ok for c in report.ran) and report.ok
    assert "example_input" in report.skipped[0].message
