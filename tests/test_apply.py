"""Apply, on gloo worlds of 2 and 4: each statement, style and option of docs/language.md §4 gives the same
parameters, placements, local shards, outputs and gradients as the hand-written torch calls, and
the placements the compiler predicted."""

import importlib.util

import pytest

from shardlang.launch.workers import WorkerError
from shardlang.runtime.torchcompat import fsdp_strided_shard

from . import dist_jobs as jobs

pytestmark = pytest.mark.distributed  # every test but the emitted-helpers table runs jobs on a gloo pool

MLP = "examples.mlp:build_model"
UNITS = "tests.models:units"

CASES = {
    "mlp_colwise_rowwise": (
        """mesh world = cpu[tp=auto]
        parallelize on world.tp { net1 : colwise; net2 : rowwise }""",
        MLP,
        "hand_mlp_tp",
        jobs.features(16),
        (2, 4),
    ),
    "init_cpu": (
        """mesh world = cpu[tp=auto]
        parallelize on world.tp { net1 : colwise; net2 : rowwise }
        init cpu""",
        MLP,
        "hand_mlp_tp",
        jobs.features(16),
        (2,),
    ),
    "mlp_sequence_parallel": (
        """mesh world = cpu[tp=auto]
        parallelize on world.tp {
            norm   : sequence_parallel
            mlp.w1 : colwise(input=shard(1))
            mlp.w2 : rowwise(output=shard(1))
        }""",
        "tests.models:seq_mlp",
        "hand_seq_mlp",
        jobs.features(8, seq=4, shard_dim=1),
        (2, 4),
    ),
    "rmsnorm_distribute": (
        """mesh world = cpu[tp=auto]
        parallelize on world.tp {
            mlp_norm : distribute(input=shard(0), output=local)
            mlp.net1 : colwise(input=shard(0))
            mlp.net2 : rowwise(output=shard(0))
        }""",
        "examples.mlp_norm:build_model",
        "hand_rmsnorm",
        jobs.features(10, batch=4, shard_dim=0),
        (2,),
    ),
    "embedding_colwise": (
        """mesh world = cpu[tp=auto]
        parallelize on world.tp { embedding : colwise; fc : rowwise }""",
        "tests.models:embed",
        "hand_embed_colwise",
        jobs.tokens(16),
        (2, 4),
    ),
    "embedding_rowwise": (
        """mesh world = cpu[tp=auto]
        parallelize on world.tp { embedding : rowwise; fc : colwise }""",
        "tests.models:embed",
        "hand_embed_rowwise",
        jobs.tokens(16),
        (2,),
    ),
    "weight_tying": (
        """mesh world = cpu[tp=auto]
        parallelize on world.tp { embedding : colwise; fc : rowwise }""",
        "examples.tied:build_model",
        "hand_tied",
        jobs.tokens(16),
        (2,),
    ),
    "tp_fsdp_2d": (
        """mesh world = cpu[dp=auto, tp=2]
        parallelize on world.tp { net1 : colwise; net2 : rowwise }
        fully_shard on world.dp { }""",
        MLP,
        "hand_2d",
        jobs.features(16, dp=2),
        (4,),
    ),
    "hsdp": (
        """mesh world = cpu[replicate=auto, shard=2]
        fully_shard on world[replicate, shard] { each u1; each u2 }""",
        UNITS,
        "hand_hsdp",
        jobs.features(8, dp=4),
        (4,),
    ),
    "hsdp_strategy_alias": (
        """mesh world = cpu[replicate=auto, shard=2]
        fully_shard on world[replicate, shard] { each {u1,u2}; strategy = hybrid_shard }""",
        UNITS,
        "hand_hsdp",
        jobs.features(8, dp=4),
        (4,),
    ),
    "mixed_precision": (
        """mesh world = cpu[dp=auto]
        fully_shard on world.dp {
            each u1 (reshard_after_forward=false)
            each u2
            mixed_precision(param=bf16, reduce=fp32)
        }""",
        UNITS,
        "hand_mixed_precision",
        jobs.features(8, dp=2),
        (2,),
    ),
    "replicate_and_fully_shard": (
        """mesh world = cpu[dp=auto]
        replicate on world.dp { each u1; root = false }
        fully_shard on world.dp { each u2 }""",
        UNITS,
        "hand_replicate_and_fully_shard",
        jobs.features(8, dp=2),
        (2,),
    ),
    "checkpoint_fully_shard": (
        """mesh world = cpu[dp=auto]
        checkpoint u1, u2
        fully_shard on world.dp { each u*; }""",
        UNITS,
        "hand_checkpoint_fully_shard",
        jobs.features(8, dp=2),
        (2,),
    ),
    "unit_options": (
        """mesh world = cpu[dp=auto]
        fully_shard on world.dp {
            each u1.0 (reshard_after_forward=2)
            each u1.2 (strategy=shard_grad_op)
            each u2 (offload=cpu)
            each head (strategy=no_shard)
            strategy = full_shard
        }""",
        UNITS,
        "hand_options",
        jobs.features(8, dp=4),
        (4,),
    ),
    "prepare_input_output": (
        """mesh world = cpu[tp=auto]
        parallelize on world.tp {
            mlp    : prepare_input(input=shard(0), desired=replicate)
            mlp.w1 : colwise
            mlp.w2 : rowwise(output=partial)
        }
        parallelize mlp on world.tp { root : prepare_output(output=partial, desired=shard(0)) }
        parallelize on world.tp { norm : sequence_parallel(dim=0, local_output=true) }""",
        "tests.models:seq_mlp",
        "hand_prepare_output",
        jobs.features(8, batch=4, seq=3, shard_dim=0),
        (2,),
    ),
    "user_styles": (
        """use examples.styles.rowwise_scaled as rowwise_scaled
        use torch.distributed.tensor.parallel.PrepareModuleInputOutput as prepare_io
        mesh world = cpu[tp=auto]
        parallelize on world.tp {
            net1 : colwise
            net2 : rowwise_scaled(scale=0.5)
            root : prepare_io(input_layouts=replicate, desired_input_layouts=replicate,
                              output_layouts=replicate, desired_output_layouts=replicate)
        }""",
        MLP,
        "hand_user_styles",
        jobs.features(16),
        (2,),
    ),
    "class_targets": (
        """mesh world = cpu[dp=auto]
        checkpoint class Sequential
        fully_shard on world.dp { each class torch.nn.Sequential }""",
        UNITS,
        "hand_checkpoint_fully_shard",
        jobs.features(8, dp=2),
        (2,),
    ),
    "distribute_output_layout": (
        """mesh world = cpu[tp=auto]
        parallelize on world.tp {
            norm   : distribute(output=replicate)
            mlp.w1 : colwise
            mlp.w2 : rowwise
        }""",
        "tests.models:seq_mlp",
        "hand_distribute_output",
        jobs.features(8, seq=3),
        (2,),
    ),
}


@pytest.mark.parametrize(("case", "world"), [(c, w) for c in sorted(CASES) for w in CASES[c][4]])
def test_plan_equals_handwritten(pools, case, world):
    plan, model, hand, make_input, _ = CASES[case]
    placements = pools(world).run(jobs.same_as_handwritten, plan, model, f"tests.dist_jobs:{hand}", make_input)
    assert placements[0]


def test_spec_placements_for_tp_and_fsdp(pools):
    """docs/checks.md's examples: colwise + FSDP, rowwise weight, rowwise bias (torch's own placements)."""
    plan, model, hand, make_input, _ = CASES["tp_fsdp_2d"]
    placements = pools(4).run(jobs.same_as_handwritten, plan, model, f"tests.dist_jobs:{hand}", make_input)[0]
    colwise = "(_StridedShard(dim=0, sf=2), Shard(dim=0))" if fsdp_strided_shard() else "(Shard(dim=0), Shard(dim=0))"
    assert placements["net1.weight"] == f"('dp', 'tp') {colwise}"
    assert placements["net2.weight"] == "('dp', 'tp') (Shard(dim=0), Shard(dim=1))"
    assert placements["net2.bias"] == "('dp', 'tp') (Shard(dim=0), Replicate())"


META_1D = """mesh world = cpu[dp=auto]
fully_shard on world.dp { each even; each odd }
init meta"""
META_2D = """mesh world = cpu[dp=auto, tp=2]
parallelize on world.tp { even : colwise; odd : rowwise }
fully_shard on world.dp { each even; each odd }
init meta"""


@pytest.mark.parametrize(("plan", "world"), [(META_1D, 2), (META_1D, 4), (META_2D, 4)], ids=["1d-2", "1d-4", "2d-4"])
def test_meta_init_gives_each_shard_its_own_values(pools, plan, world):
    report = pools(world).run(jobs.meta_init_matches_unsharded, plan, "tests.models:uneven")[0]
    assert "odd.weight" in report and "even.weight" in report


def test_rank0_init_scatters_rank0_values_bitwise(pools):
    plan = """mesh world = cpu[dp=auto, tp=2]
    parallelize on world.tp { net1 : colwise; net2 : rowwise }
    fully_shard on world.dp { }
    init rank0"""
    pools(4).run(jobs.rank0_init_is_bitwise, plan, MLP)


def test_rank0_init_keeps_non_persistent_buffers(pools):
    plan = """mesh world = cpu[dp=auto]
    fully_shard on world.dp { each layers.* }
    init rank0"""
    pools(2).run(jobs.rank0_init_is_bitwise, plan, "examples.llama:build_model")


def test_loss_parallel_gives_the_unsharded_loss(pools):
    plan = """mesh world = cpu[tp=auto]
    parallelize on world.tp { output : colwise(output=shard(-1), local_output=false) }
    loss_parallel"""
    pools(2).run(jobs.loss_parallel_matches_unsharded, plan)


def test_checks_gather_by_hand_what_torch_cannot_redistribute(pools):
    """The checks' fallback for full_tensor (torch 2.11 cannot plan FSDP's Shard(1) over a packed weight's
    _StridedShard(0)) gives the whole tensor, as full_tensor does where it can."""
    for placements, by_hand, by_torch in pools(4).run(jobs.gathered_matches_full_tensor)[0]:
        assert by_hand and by_torch is not False, placements


def test_scatter_from_rank0_loads_what_torch_loads(pools):
    """`init rank0`'s own load (for offloaded shards, which torch's broadcast_from_rank0 cannot load on
    GPUs) gives every rank the shards torch gives it."""
    assert all(pools(4).run(jobs.scatter_matches_torchs_broadcast))


def test_sync_over_makes_replicas_equal(pools):
    """Ranks build the model with different seeds; `sync over` broadcasts rank 0's parameters and buffers
    (FSDP-sharded parameters are left to their shards)."""
    unsynced = "mesh world = cpu[dp=auto]\nfully_shard on world.dp { }\n"
    assert not all(pools(4).run(jobs.sync_makes_replicas_equal, unsynced, "examples.buffers:build_model", "dp")[0])
    synced = unsynced + "sync over world.dp\n"
    assert all(pools(4).run(jobs.sync_makes_replicas_equal, synced, "examples.buffers:build_model", "dp")[0])


FAILING_STYLE = """use tests.dist_jobs.raise_after_change as flaky
mesh world = cpu[dp=auto, tp=2]
parallelize on world.tp { net1 : colwise; net2 : flaky }
fully_shard on world.dp { }"""
FAILING_INIT = """mesh world = cpu[dp=auto]
checkpoint net1
fully_shard on world.dp { each net1 }
init meta"""


@pytest.mark.parametrize(
    ("plan", "expect"),
    [(FAILING_STYLE, "planted failure"), (FAILING_INIT, "planted init failure")],
    ids=["user-style", "init-after-fully-shard"],
)
def test_failed_apply_leaves_the_model_exactly_as_it_was(pools, plan, expect):
    messages = pools(2).run(jobs.failing_apply_leaves_model_unchanged, plan, "tests.models:failing_mlp")
    assert all(expect in m for m in messages)


@pytest.mark.parametrize(
    ("plan_name", "model", "world"),
    [
        ("llama_2d", "examples.llama:build_model", 4),
        ("mlp_norm_2d", "examples.mlp_norm:build_model", 4),
        ("hsdp", "examples.llama:build_model", 4),
        ("llama_custom_styles", "examples.llama:build_model", 4),
        ("mlp_tp", "examples.mlp:build_model", 2),
        ("llama_fsdp_offload", "examples.llama:build_model", 2),  # init meta
    ],
)
@pytest.mark.parametrize("with_model", [True, False], ids=["for-the-model", "for-any-model"])
def test_emitted_python_gives_the_same_placements(pools, plan_name, model, world, with_model):
    from .conftest import ROOT

    text = (ROOT / "plans" / f"{plan_name}.sl").read_text()
    assert pools(world).run(jobs.emitted_code_matches_apply, text, model, world, with_model)[0]


def test_every_pasted_helper_comes_with_the_helpers_it_calls():
    """`compile --emit python` pastes the helpers of each step the program has (runtime.steps' table): a
    helper that calls another of shardlang's helpers the same step does not paste would be a NameError in
    the printed program."""
    import importlib
    import inspect
    import types

    from shardlang.compiler import initialisers
    from shardlang.runtime.steps import STEPS

    runtime = "broadcasts building gathering materialise meshes moving ownstyles rank0 ties units".split()
    pasted_modules = [initialisers, *(importlib.import_module(f"shardlang.runtime.{name}") for name in runtime)]
    ours = {
        f.__name__
        for module in pasted_modules
        for _, f in inspect.getmembers(module, inspect.isfunction)
        if f.__module__ == module.__name__
    }

    def called(code) -> set[str]:
        names = set(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names |= called(const)
        return names

    always = {"build_for", "parameters_on_meta"}
    missing = {}
    for step_type, kind in STEPS.items():
        pasted = {h.__name__ for h in kind.helpers} | always
        for helper in kind.helpers:
            codes = [f.__code__ for _, f in inspect.getmembers(helper, inspect.isfunction)] or [helper.__code__]
            lacking = (set().union(*map(called, codes)) & ours) - pasted - {helper.__name__}
            if lacking:
                missing[f"{step_type.__name__}: {helper.__name__}"] = sorted(lacking)
    assert not missing, missing


def test_worker_failure_names_the_rank(pools):
    with pytest.raises(WorkerError) as raised:
        pools(2).run(
            jobs.failing_apply_leaves_model_unchanged,
            "mesh world = cpu[dp=auto]\nfully_shard on world.dp { }\n",
            "tests.models:units",
        )
    assert "apply did not fail" in str(raised.value)


GPT2_TP = """use {colwise} as colwise_c1d
use examples.styles.RowwiseConv1D as rowwise_c1d
mesh world = cpu[tp=auto]
parallelize transformer.h.* on world.tp {{
    attn.c_attn : colwise_c1d(output_layouts=replicate)
    attn.c_proj : rowwise_c1d(input_layouts=replicate)
    mlp.c_fc    : colwise_c1d
    mlp.c_proj  : rowwise_c1d
}}
init cpu
verify placements
"""


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs pip install -e '.[hf]'")
def test_placements_of_use_styles_for_gpt2_conv1d_are_what_the_styles_do(pools, tmp_path):
    """ColwiseParallel/RowwiseParallel subclasses for GPT-2's Conv1D (weight [in, out]): every tensor is
    predicted (by running the styles in a simulated world) and placed so; a style that leaves one rank's
    bias plain fails the check on that rank."""
    import shardlang
    from shardlang.launch.job import Job, run

    from .conftest import ROOT

    reports = {}
    for name, colwise in [
        ("correct", "examples.styles.ColwiseConv1D"),
        ("wrong", "tests.faults.styles.ColwiseConv1DBiasPlainOnRank1"),
    ]:
        path = tmp_path / f"{name}.sl"
        path.write_text(GPT2_TP.format(colwise=colwise))
        job = Job(str(path), {}, str(ROOT / "examples" / "hf_gpt2.py"), None, shardlang.load(path).checks)
        (reports[name],) = [r.checks for r in pools(2).run(run, job)[:1]]
    (correct,), (wrong,) = reports["correct"], reports["wrong"]
    assert correct.status == "pass" and "not predicted" not in correct.message, correct.message
    tensors = int(correct.message.split()[0])
    assert (
        tensors == 2 + 2 * 12 + 2 + 1
    )  # wte, wpe; per block ln_1, c_attn, c_proj, ln_2, c_fc, c_proj (x2 each); ln_f; lm_head
    assert wrong.status == "fail", wrong.message
    for words in ("rank 1", "transformer.h.0.attn.c_attn.bias: predicted world[tp] (Shard(0))", "got plain tensor"):
        assert words in wrong.message, wrong.message
