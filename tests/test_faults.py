"""Planted faults: each check must report its fault as failed, with a useful message (and, where the
gradients check fails, the first module that disagrees and the plan line that governs it), and pass once
the fault is fixed. Many are faults users shipped. Runs `shardlang apply`'s job on the test worker pools."""

import pytest

from shardlang.frontend.schema import CHECKS
from shardlang.launch.job import Job, run

LLAMA_TP = """mesh world = cpu[dp=auto, tp=2]
parallelize layers.* on world.tp {{
    attention.{{wq,wv}} : colwise
    attention.wk        : {wk}
    attention.wo        : rowwise
    feed_forward.{{w1,w3}} : colwise
    feed_forward.w2     : rowwise
}}
fully_shard on world.dp {{ each layers.*; mixed_precision(param=bf16, reduce=fp32) }}
"""
SEQ_NORM = """mesh world = cpu[tp=auto]
parallelize on world.tp {{
{norm}    mlp    : prepare_input(input=shard(1), desired=replicate)
    mlp.w1 : colwise
    mlp.w2 : rowwise(output=shard(1))
}}
verify gradients(steps=1, input=shard(1), output=shard(1))
"""
#: The same block data parallel too, its gradients reduced in bf16 (the reference must round as the reduction does).
SEQ_NORM_BF16_REDUCE = SEQ_NORM.replace("cpu[tp=auto]", "cpu[dp=auto, tp=2]").replace(
    "verify", "fully_shard on world.dp {{ mixed_precision(param=fp32, reduce=bf16) }}\nverify"
)
MLP_USE = "use tests.faults.styles.{style} as odd\nmesh world = cpu[tp=auto]\n"

FAULTS = {
    # name: (world, model or (faulty model, fixed model), check, faulty plan, fixed plan,
    #        words the failure message must contain, the module the failure is localised to)
    "buffer differs across data-parallel ranks": (
        2,
        "tests/faults/rank_buffer.py",
        "module_states",
        "mesh world = cpu[dp=auto]\nfully_shard on world.dp { }\nverify module_states\n",
        "mesh world = cpu[dp=auto]\nfully_shard on world.dp { }\nsync over world.dp\nverify module_states\n",
        ["steps", "world.dp", "max difference 1"],
        None,
    ),
    "a use style wrong on one rank": (
        2,
        "examples/mlp.py",
        "gradients",
        MLP_USE.format(style="colwise_off_on_rank1") + "parallelize on world.tp { net1 : odd; net2 : rowwise }\n"
        "verify gradients(steps=1)\n",
        MLP_USE.format(style="colwise") + "parallelize on world.tp { net1 : odd; net2 : rowwise }\n"
        "verify gradients(steps=1)\n",
        ["loss", "step 0"],
        "net1",
    ),
    "a parameter left on meta": (
        2,
        "examples/mlp.py",
        "init_device",
        MLP_USE.format(style="colwise_bias_on_meta") + "parallelize on world.tp { net1 : odd; net2 : rowwise }\n"
        "verify init_device\n",
        MLP_USE.format(style="colwise") + "parallelize on world.tp { net1 : odd; net2 : rowwise }\n"
        "verify init_device\n",
        ["net1.bias (meta)", "still on meta"],
        None,
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
        None,
    ),
    "a wrong collective count": (
        2,
        "examples/mlp.py",
        "comms",
        "mesh world = cpu[tp=auto]\nparallelize on world.tp { net1 : colwise; net2 : rowwise }\nverify comms(all_reduce=5)\n",
        "mesh world = cpu[tp=auto]\nparallelize on world.tp { net1 : colwise; net2 : rowwise }\nverify comms(all_reduce=1)\n",
        ["all_reduce: expected 5, counted 1"],
        None,
    ),
    "a replicated norm weight in a sequence-parallel region, never all-reduced": (
        2,
        "tests/faults/seq_norm.py",
        "gradients",
        SEQ_NORM.format(norm=""),
        SEQ_NORM.format(norm="    norm   : sequence_parallel\n"),
        ["gradient of norm.weight"],
        "norm",
    ),
    "a replicated norm weight never all-reduced, under FSDP reducing in bf16": (
        4,
        "tests/faults/seq_norm.py",
        "gradients",
        SEQ_NORM_BF16_REDUCE.format(norm=""),
        SEQ_NORM_BF16_REDUCE.format(norm="    norm   : sequence_parallel\n"),
        ["gradient of norm.weight"],
        "norm",
    ),
    "a replicated norm weight never all-reduced, in a model with a kernel that refuses float64": (
        2,
        "tests/faults/no_float64.py",
        "gradients",
        SEQ_NORM.format(norm=""),
        SEQ_NORM.format(norm="    norm   : sequence_parallel\n"),
        ["gradient of norm.weight", "the float32 truth's own"],
        "norm",
    ),
    "a rowwise bias added on every TP rank before the reduction": (
        2,
        "examples/mlp.py",
        "gradients",
        MLP_USE.format(style="rowwise_bias_every_rank") + "parallelize on world.tp { net1 : colwise; net2 : odd }\n"
        "verify gradients(steps=1)\n",
        MLP_USE.format(style="rowwise_bias_once") + "parallelize on world.tp { net1 : colwise; net2 : odd }\n"
        "verify gradients(steps=1)\n",
        ["step 0: loss"],
        "net2",
    ),
    "a user style that forgets to redistribute its output": (
        2,
        "examples/mlp.py",
        "gradients",
        MLP_USE.format(style="rowwise_no_reduce") + "parallelize on world.tp { net1 : colwise; net2 : odd }\n"
        "verify gradients(steps=1)\n",
        MLP_USE.format(style="rowwise_bias_once") + "parallelize on world.tp { net1 : colwise; net2 : odd }\n"
        "verify gradients(steps=1)\n",
        ["step 0: loss"],
        "net2",
    ),
    "a loss averaged over the TP group as if it were data parallel": (
        2,
        ("tests/faults/tp_loss.py", "examples/seeds/classifier.py"),
        "gradients",
        "mesh world = cpu[tp=auto]\nparallelize on world.tp { output : colwise(output=shard(-1), local_output=false) }\n"
        "loss_parallel\nverify gradients(steps=1)\n",
        "mesh world = cpu[tp=auto]\nparallelize on world.tp { output : colwise(output=shard(-1), local_output=false) }\n"
        "loss_parallel\nverify gradients(steps=1)\n",
        ["step 0: loss"],
        "output",
    ),
    "one attention head's rows sharded to the wrong rank": (
        4,
        "examples/llama.py",
        "init",
        "use tests.faults.styles.colwise_heads_swapped as heads\n"
        + LLAMA_TP.format(wk="heads")
        + "init cpu\nverify init\n",
        LLAMA_TP.format(wk="colwise") + "init cpu\nverify init\n",
        ["layers.0.attention.wk.weight: not bitwise equal"],
        None,
    ),
    "one KV head of eight gets no gradient, under bf16 mixed precision": (
        4,
        "tests/faults/llama8.py",
        "gradients",
        "use tests.faults.styles.colwise_head0_frozen as frozen\n"
        + LLAMA_TP.format(wk="frozen")
        + "verify gradients(steps=1)\n",
        LLAMA_TP.format(wk="colwise") + "verify gradients(steps=1)\n",
        ["gradient of layers.0.attention.wk.weight"],
        "layers.0.attention.wk",
    ),
    "an uneven shard that drops the last rows": (
        4,
        "tests/faults/uneven_mlp.py",
        "init",
        "use tests.faults.styles.colwise_drops_last_rows as drops\nmesh world = cpu[tp=auto]\n"
        "parallelize on world.tp { net1 : drops }\ninit cpu\nverify init\n",
        "mesh world = cpu[tp=auto]\nparallelize on world.tp { net1 : colwise(output=replicate) }\ninit cpu\nverify init\n",
        ["net1.weight: (8, 16) float32, unsharded (10, 16)"],
        None,
    ),
    "a forward wrong on one replica, under HSDP and activation checkpointing": (
        4,
        ("tests/faults/rank_scaled.py", "examples/mlp.py"),
        "gradients",
        "mesh world = cpu[rep=2, shard=2]\nfully_shard on world[rep, shard] { each net1; each net2 }\n"
        "checkpoint net1, net2\nverify gradients(steps=1)\n",
        "mesh world = cpu[rep=2, shard=2]\nfully_shard on world[rep, shard] { each net1; each net2 }\n"
        "checkpoint net1, net2\nverify gradients(steps=1)\n",
        ["step 0: gradient of net2.weight"],
        "net2",
    ),
    "a forward wrong on one replica, under HSDP reducing in bf16 (two reductions)": (
        4,
        ("tests/faults/rank_scaled.py", "examples/mlp.py"),
        "gradients",
        "mesh world = cpu[rep=2, shard=2]\nfully_shard on world[rep, shard] { each net1; each net2\n"
        "    mixed_precision(param=fp32, reduce=bf16) }\nverify gradients(steps=1)\n",
        "mesh world = cpu[rep=2, shard=2]\nfully_shard on world[rep, shard] { each net1; each net2\n"
        "    mixed_precision(param=fp32, reduce=bf16) }\nverify gradients(steps=1)\n",
        ["step 0: loss"],
        "net2",
    ),
    "an init method that fills every shard alike": (
        2,
        "tests/faults/shard_init.py",
        "init",
        "mesh world = cpu[dp=auto]\nfully_shard on world.dp { each net1; each net2 }\ninit meta with init_weights\n"
        "verify init\n",
        "mesh world = cpu[dp=auto]\nfully_shard on world.dp { each net1; each net2 }\n"
        "init meta with init_weights_per_rank\nverify init\n",
        ["net1.weight: ranks 0 and 1 hold identical shards"],
        None,
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
    world, model, check, faulty, fixed, words, module = FAULTS[fault]
    faulty_model, fixed_model = model if isinstance(model, tuple) else (model, model)
    assert check in CHECKS
    report = pools(world).run(run, _job(tmp_path, "faulty", faulty, faulty_model))[0]
    (result,) = report.checks
    assert result.check == check and result.status == "fail", result
    for word in words:
        assert word in result.message, f"{word!r} not in {result.message!r}"
    errors = [d for d in report.diagnostics if d.is_error]
    assert {d.code for d in errors} == {"SL400"} and errors[0].span.line == faulty.count(
        "\n", 0, faulty.index("verify")
    ) + 1
    if module is not None:
        where = result.data["localised"]
        assert where["module"] == module, where
        (located,) = [d for d in errors if d.message.startswith("first disagreement")]
        assert f"module '{module}'" in located.message
        if where["statements"]:
            assert located.span is not None and located.span.line == where["statements"][0]["line"]
    report = pools(world).run(run, _job(tmp_path, "fixed", fixed, fixed_model))[0]
    (result,) = report.checks
    assert result.status == "pass", result.message
    assert report.ok


def test_every_check_is_covered_by_a_fault():
    assert set(CHECKS) == {f[2] for f in FAULTS.values()}


def test_check_without_example_input_is_not_run_and_not_passed(pools, tmp_path):
    (tmp_path / "noinput.py").write_text("from examples.mlp import build_model\n")
    job = _job(
        tmp_path,
        "noinput",
        "mesh world = cpu[tp=auto]\nparallelize on world.tp { net1 : colwise; net2 : rowwise }\n",
        str(tmp_path / "noinput.py"),
    )
    assert [c.name for c in job.checks] == ["gradients", "init", "module_states", "init_device", "placements", "comms"]
    report = pools(2).run(run, job)[0]
    skipped = {c.check for c in report.skipped}
    assert skipped == {"gradients", "comms"}
    assert all(c.status == "pass" for c in report.ran) and report.ok
    assert report.summary == "4 passed, 2 skipped"
    assert "example_input" in report.skipped[0].message
