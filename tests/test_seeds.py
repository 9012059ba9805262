"""The seed scenarios (issue 5): PyTorch's own FSDP/TP tests, each declared as a plan and run through
what `shardlang apply` runs on every rank, with the assertions the original test makes.

Test names start with the PyTorch test file and case they come from; docs/design-notes.md lists every scenario
with its plan."""

import re

import pytest
import torch

import shardlang
from shardlang.launch.job import Job, run

from . import seed_jobs
from .conftest import FIXTURES, ROOT

SEEDS = ROOT / "plans" / "seeds"


def model_of(plan) -> str:
    return str(ROOT / re.search(r"Model: (\S+\.py)", plan.read_text()).group(1))


def apply_and_check(pools, plan, world: int = 4, drop: str | None = None):
    """`shardlang apply`'s job for `plan` (optionally without the lines containing `drop`)."""
    text = plan.read_text()
    if drop is not None:
        text = "".join(line for line in text.splitlines(keepends=True) if drop not in line)
    checks = shardlang.loads(text).checks
    path = plan if drop is None else plan.with_name(f".{plan.stem}_without.sl")
    if drop is not None:
        path.write_text(text)
    try:
        return pools(world).run(run, Job(str(path), {}, model_of(plan), None, checks, explicit=True))[0]
    finally:
        if drop is not None:
            path.unlink()


def assert_all_pass(report):
    """Every check passed; comms may be `reported` where the plan gives no counts (it compared nothing)."""
    assert report.ok, [(c.check, c.status, c.message) for c in report.checks] + [
        d.message for d in report.diagnostics if d.is_error
    ]
    assert all(c.status == "pass" or (c.check, c.status) == ("comms", "reported") for c in report.checks), [
        (c.check, c.status, c.message) for c in report.checks
    ]


def lint_codes(plan, model_path, world):
    with torch.device("meta"):
        model = shardlang.runtime.modelfile.load_model_file(model_path).build_model()
    return [d.code for d in shardlang.load(plan).lint(model, world_size=world)]


# --- 1. test_fsdp_tp_integration.py ------------------------------------------------------------


@pytest.mark.distributed
def test_fsdp_tp_integration__extension_grad(pools):
    """2-D (dp, tp): net1 colwise(input=shard(0)), net2 rowwise(output=shard(0)), a distributed
    RMSNorm, FSDP over dp. Gradients match the reference (finite: no NaN), and the collectives of one
    forward+backward are those of the same model parallelised by hand in the same run."""
    plan = ROOT / "plans" / "mlp_norm_2d.sl"
    text = plan.read_text().replace(
        "verify gradients(steps=2, input=shard(0), output=shard(0))",
        "verify gradients(steps=2, input=shard(0), output=shard(0)), comms",
    )
    path = plan.with_name(".mlp_norm_2d_comms.sl")
    path.write_text(text)
    try:
        result = pools(4).run(
            seed_jobs.checks_and_counts_against_handwritten,
            str(path),
            str(ROOT / "examples/mlp_norm.py"),
            "hand_tp_fsdp_integration",
        )[0]
    finally:
        path.unlink()
    assert all(status in ("pass", "reported") for _, status, _ in result["checks"]), result["checks"]
    assert result["plan_counts"] == result["hand_counts"]
    assert (
        result["plan_counts"]["all_gather_into_tensor"] >= 1 and result["plan_counts"]["reduce_scatter_tensor"] >= 1
    )  # TP
    assert (
        result["plan_counts"]["_allgather_base_"] >= 1 and result["plan_counts"]["_reduce_scatter_base_"] >= 1
    )  # FSDP


@pytest.mark.distributed
def test_fsdp_tp_integration__sync_module_state(pools):
    """A parameter and a buffer start different on each rank; after `sync over world.dp` the local
    tensors are equal along dp (module_states); without it the plan is SL217 (a dim nothing uses)."""
    plan = SEEDS / "tp_fsdp_sync_module_state.sl"
    assert_all_pass(apply_and_check(pools, plan))
    # Without the sync nothing names world.dp: lint stops it before it runs (SL217), where PyTorch's test
    # (and shardlang before SL217) let it run and found the dp replicas' states apart.
    report = apply_and_check(pools, plan, drop="sync over")
    assert not report.usable and "SL217" in {d.code for d in report.diagnostics}, report.diagnostics


# --- 2. _composable/test_compose.py ------------------------------------------------------------

COMPOSE = [
    "compose_checkpoint_submodules",  # test_checkpoint_fsdp_submodules_non_reentrant
    "compose_checkpoint_with_param",  # test_checkpoint_fsdp_submodules_with_param
    "compose_checkpoint_no_shard",  # test_checkpoint_fsdp_submodules_with_param_no_shard
    "compose_wrap_same_submodule",  # test_wrap_same_submodule
    "compose_linear_by_class",  # test_fully_shard_replicate_correct_replicate_params
    "compose_1fm_1r",  # test_fully_shard_replicate_composability: the six configs
    "compose_1r_1fm",
    "compose_1r_1fa",
    "compose_1r1fm_1fm",
    "compose_1r1fa_1fm",
    "compose_1fm1fm_1r1r_1fm",
]


@pytest.mark.distributed
@pytest.mark.parametrize("name", COMPOSE)
def test_compose__loss_parity_with_a_replicated_reference(pools, name):
    """fully_shard, replicate and checkpoint composed: losses, gradients and updates match the
    unsharded reference trained on every replica's inputs (the original's DDP-replicated base model)."""
    assert_all_pass(apply_and_check(pools, SEEDS / f"{name}.sl", world=2))


@pytest.mark.distributed
def test_compose__replicate_parameters_are_the_rest(pools):
    """test_fully_shard_replicate_correct_replicate_params: with every Linear fully sharded, what the
    root's replicate manages is exactly the other parameters (here: `p`, plain tensors)."""
    plan = SEEDS / "compose_linear_by_class.sl"
    report = apply_and_check(pools, plan, world=2)
    placements = next(c for c in report.checks if c.check == "placements")
    assert placements.ok


@pytest.mark.distributed
def test_compose__cast_forward_inputs(pools):
    """fp16 inputs inside the fp16 unit (also when checkpointing recomputes it), fp32 outside."""
    seen = pools(2).run(
        seed_jobs.cast_forward_inputs,
        str(SEEDS / "compose_cast_forward_inputs.sl"),
        str(ROOT / "examples/seeds/forward_inputs.py"),
    )[0]
    assert seen["root"] == ["float32"] and seen["c1"] == ["float32"]
    assert seen["c2"] and set(seen["c2"]) == {"float16"}


def test_compose__fully_shard_and_replicate_on_one_module_is_sl205():
    assert lint_codes(FIXTURES / "lint" / "sl205_both_units.sl", str(ROOT / "tests/faults/composite_units.py"), 2) == [
        "SL205"
    ]


# --- 3. _composable/fsdp/test_fully_shard_init.py ----------------------------------------------


@pytest.mark.distributed
def test_fully_shard_init__states_moved_to_the_mesh_device(pools):
    assert_all_pass(apply_and_check(pools, SEEDS / "fully_shard_init_device.sl"))


def test_fully_shard_init__cpu_tp_mesh_with_cuda_fsdp_mesh_is_sl208_before_any_change():
    assert lint_codes(FIXTURES / "lint" / "sl208_mixed_devices.sl", str(ROOT / "examples/mlp.py"), 4) == [
        "SL208",
        "SL208",
    ]


def test_fully_shard_init__3d_mesh_is_sl106():
    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.load(FIXTURES / "invalid" / "sl106_mesh.sl")
    assert {d.code for d in raised.value.diagnostics} == {"SL106"}


@pytest.mark.distributed
def test_fully_shard_init__shared_parameters_and_a_module_used_twice(pools):
    plan = SEEDS / "fully_shard_shared_params.sl"
    assert_all_pass(apply_and_check(pools, plan, world=2))
    facts = pools(2).run(seed_jobs.shared_parameters, str(plan), model_of(plan))[0]
    assert facts["tied"] and facts["buffer_shared"] and facts["all_dtensors"]
    assert facts["params"] == facts["unique_params"]


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_fully_shard_init__uneven_shards_are_exact_chunks(pools, world):
    plan = SEEDS / "fully_shard_uneven.sl"
    assert_all_pass(apply_and_check(pools, plan, world=world))
    shapes = pools(world).run(seed_jobs.exact_uneven_chunks, str(plan), model_of(plan))
    odd = [s["odd.weight"] for s in shapes]
    assert odd == ([(2, 8), (1, 8)] if world == 2 else [(1, 8), (1, 8), (1, 8), (0, 8)])


@pytest.mark.distributed
def test_fully_shard_init__2d_placements_as_torch_gives_them(pools):
    report = apply_and_check(pools, SEEDS / "fully_shard_2d_placements.sl")
    assert_all_pass(report)
    placements = next(c for c in report.checks if c.check == "placements")
    assert placements.data["matched"] == 4 and not placements.data["wrong"]


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["fully_shard_meta_init_1d", "fully_shard_meta_init_2d"])
def test_fully_shard_init__meta_device_init_then_an_optimizer_step(pools, name):
    assert_all_pass(apply_and_check(pools, SEEDS / f"{name}.sl"))


@pytest.mark.distributed
def test_fully_shard_init__forgetting_to_materialise_lists_what_is_on_meta(pools):
    message = pools(2).run(
        seed_jobs.forgot_to_materialise,
        "mesh world = cpu[dp=auto]\nfully_shard on world.dp { each odd }\n",
        str(ROOT / "examples/seeds/uneven.py"),
    )[0]
    assert "6 tensors are on the meta device: even.weight, even.bias, odd.weight" in message


@pytest.mark.distributed
def test_fully_shard_init__hsdp_replicas_made_equal_by_sync_then_trained(pools):
    plan = SEEDS / "hsdp_sync.sl"
    assert_all_pass(apply_and_check(pools, plan))
    report = apply_and_check(pools, plan, drop="sync over")
    assert next(c for c in report.checks if c.check == "module_states").ok is False


# --- 4. tensor/parallel/test_tp_examples.py ----------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize(
    "plan", [ROOT / "plans" / "mlp_tp.sl", SEEDS / "tp_mlp_sequence_parallel.sl"], ids=["mlp", "mlp_sequence_parallel"]
)
def test_tp_examples__mlp_training_and_inference(pools, plan):
    """Training (gradients over steps) and inference (the losses are forward passes) with and without
    sequence parallelism."""
    assert_all_pass(apply_and_check(pools, plan, world=2))


@pytest.mark.distributed
def test_tp_examples__weight_tying(pools):
    plan = SEEDS / "tp_weight_tying.sl"
    assert_all_pass(apply_and_check(pools, plan, world=2))
    facts = pools(2).run(seed_jobs.weight_tying, str(plan), model_of(plan))[0]
    assert facts["same_object"] and facts["same_grad"] and facts["placement"] == "(Shard(dim=1),)"


@pytest.mark.distributed
def test_tp_examples__loss_parallel_counts_as_torch_gives_them(pools):
    plan = SEEDS / "tp_loss_parallel.sl"
    result = pools(2).run(
        seed_jobs.checks_and_counts_against_handwritten, str(plan), model_of(plan), "hand_loss_parallel"
    )[0]
    assert all(status in ("pass", "reported") for _, status, _ in result["checks"]), result["checks"]
    assert result["plan_counts"] == result["hand_counts"]
    assert result["plan_counts"]["all_reduce"] >= 3  # cross-entropy's max, sum-exp and target gathers


def test_tp_examples__loss_parallel_sharded_on_another_dim_is_sl207():
    assert lint_codes(FIXTURES / "lint" / "sl207_class_dim.sl", str(ROOT / "examples/seeds/classifier.py"), 2) == [
        "SL207"
    ]


# --- 5. test_fake_pg.py --------------------------------------------------------------------------


def test_fake_pg__lint_a_tp_fsdp_plan_at_world_1024():
    """The Llama plan (TP 8 x FSDP 128) linted at a simulated world of 1024 in this one process."""
    import examples.llama as llama

    plan = shardlang.load(ROOT / "plans" / "llama_2d.sl", params={"tp": 8})
    with torch.device("meta"):
        model = llama.Transformer(vocab=32768, dim=1024, heads=16, layers=8, hidden=4096, seq=128)
    assert plan.lint(model, world_size=1024) == []


@pytest.mark.distributed
def test_fake_pg__explain_a_tp_fsdp_plan_at_world_1024():
    """The same plan explained at 1024 ranks (tp 4: the example has 4 heads): one process (the
    command's), the fake process group."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardlang",
            "explain",
            "plans/llama_2d.sl",
            "examples/llama.py",
            "--world",
            "1024",
            "-D",
            "tp=4",
            "--rank",
            "1023",
            "--format",
            "json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)
    assert data["world_size"] == 1024 and data["rank"] == 1023
    wq = next(t for t in data["tensors"] if t["name"] == "layers.0.attention.wq.weight")
    assert wq["dims"] == ["dp", "tp"] and wq["placements"][1] == "S(0)"
    assert {c["mesh_dim"] for c in data["collectives"]} == {"world.dp", "world.tp"}, data["notes"]
