"""Expert parallelism (issue 27): the expert_parallel runtime on transformers' own stacked experts."""

from __future__ import annotations

import re

import pytest
import torch

from . import expert_jobs
from .conftest import ROOT, shardlang_cli

pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_split_experts_equal_whole_ones_in_output_and_every_gradient(pools, world, implementation):
    """Qwen3-MoE's experts split over ep (2 experts a rank at world 2, 1 at world 4), each rank routing its
    own tokens: the output, the gradients of the tokens and of the routing weights, and each rank's experts'
    gradients (summed over every rank's tokens) equal those of the whole experts."""
    for errors in pools(world).run(expert_jobs.ep_matches_whole_experts, implementation):
        assert max(errors.values()) < 1e-5, errors


@pytest.mark.distributed
def test_a_rank_that_receives_no_token(pools):
    """Every token chooses the experts of rank 0: rank 1 computes on no rows and still takes part."""
    for errors in pools(2).run(expert_jobs.ep_matches_whole_experts, "eager", True):
        assert max(errors.values()) < 1e-5, errors


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_experts_split_by_width_equal_whole_ones(pools, world, implementation):
    """expert_tensor_parallel (transformers' moe_tp_experts) on Qwen3-MoE's experts: the output and every
    gradient (the tokens', the routing weights', each expert's) equal those of the whole experts."""
    for errors in pools(world).run(expert_jobs.etp_matches_whole_experts, implementation):
        assert max(errors.values()) < 1e-5, errors


@pytest.mark.distributed
def test_experts_split_by_width_with_partial_input_gradients_are_wrong(pools):
    """The planted fault: the tokens' and routing weights' gradients left partial on each tp rank."""
    for errors in pools(2).run(expert_jobs.etp_matches_whole_experts, "eager", True):
        assert errors["hidden_grad"] > 1e-3 and errors["weights_grad"] > 1e-3, errors
        assert errors["output"] < 1e-5, errors


@pytest.mark.distributed
def test_tokens_combined_without_their_weights_are_wrong(pools):
    """The check above can fail: dropping the routing weights changes the output."""
    assert min(pools(2).run(expert_jobs.ep_without_weights_differs)) > 1e-2


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["list", "switch"])
@pytest.mark.parametrize("shared", [False, True], ids=["own-tokens", "shared-tokens"])
def test_experts_held_as_modules_split_by_member(pools, world, kind, shared):
    """A ModuleList of torch MLPs (top-2, a padding choice) and transformers' SwitchTransformers experts (a
    ModuleDict, one-hot top-1 routing, a token over capacity): each rank keeps its block of members under
    their own keys; the output and every gradient equal the whole experts'."""
    for errors in pools(world).run(expert_jobs.member_ep_matches_whole_experts, kind, shared):
        assert max(errors.values()) < 1e-12, errors


@pytest.mark.distributed
def test_experts_held_as_modules_on_a_rank_that_receives_no_token(pools):
    for errors in pools(2).run(expert_jobs.member_ep_matches_whole_experts, "list", False, 7, True):
        assert max(errors.values()) < 1e-12, errors


@pytest.mark.distributed
def test_a_member_missing_from_the_rank_that_should_hold_it_fails_placements(pools):
    """The placements check compares which members each rank holds with the prediction: rank 0, which lost
    one of its two experts, fails naming it; rank 1, which holds its own, passes."""
    (status0, message0), (status1, message1) = pools(2).run(expert_jobs.placements_of_a_member_dropped_on_rank_0)
    assert status0 == "fail", message0
    assert "encoder.block.0.layer.1.mlp.experts.expert_0.wi.weight: predicted held here (expert 0 of 4" in message0
    assert "got held elsewhere" in message0
    assert status1 == "pass" and "held by other ranks, as predicted" in message1, message1


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["list", "switch"])
def test_experts_held_as_modules_combined_without_their_weights_are_wrong(pools, kind):
    assert min(pools(2).run(expert_jobs.member_ep_without_weights_differs, kind)) > 1e-2


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "tokens"), [(2, 7), (4, 7), (4, 3)])
def test_ranks_that_share_their_tokens_route_one_slice_each(pools, world, tokens):
    """Ranks holding the same tokens (a tensor-parallel dim): each routes its slice (7 tokens over 2 or 4
    ranks: uneven; 3 over 4: one rank has none), and the output and gradients equal the whole experts'
    (sending every token from every rank would count each expert's gradient `world` times)."""
    for errors in pools(world).run(expert_jobs.ep_shared_batch_matches_whole_experts, tokens):
        assert max(errors.values()) < 1e-5, errors


# --- the style in a plan ----------------------------------------------------------------------------

EP_PLAN = ROOT / "plans" / "hf" / "qwen3_moe_ep.sl"
QWEN3_MOE = str(ROOT / "examples" / "hf_qwen3_moe.py")
OLMOE = str(ROOT / "examples" / "field" / "olmoe.py")


@pytest.mark.distributed
def test_a_token_sent_by_every_rank_that_holds_it_fails_the_gradients_check_at_the_experts(tmp_path, pools):
    """The plan's expert_parallel passes; the same experts routing every token from both tp ranks (the
    data-parallel form on ranks that share their batch) count each expert's gradient twice, and the
    gradients check fails at the experts' rule."""
    import shardlang
    from shardlang.launch.job import Job, run

    plan = EP_PLAN.read_text().replace("init meta", "init meta\nverify gradients(steps=1)")
    twice = plan.replace("mesh world", "use shardlang.runtime.experts.ExpertParallel as twice\n\nmesh world", 1)
    twice = twice.replace(": expert_parallel", ": twice(shared_batch=false)")
    reports = {}
    for name, text in (("fixed", plan), ("twice", twice)):
        path = tmp_path / f"{name}.sl"
        path.write_text(text)
        job = Job(str(path), {}, QWEN3_MOE, None, shardlang.load(path).checks)
        reports[name] = pools(4).run(run, job)[0]
    (fixed,) = reports["fixed"].checks
    assert fixed.status == "pass", fixed.message
    (wrong,) = reports["twice"].checks
    assert wrong.status == "fail" and "mlp.experts.gate_up_proj" in wrong.message, wrong.message
    (where,) = [d for d in reports["twice"].diagnostics if "first disagreement" in d.message]
    # Any layer's experts, or a module inside them: with the references routing as the sharded run did
    # (verification/routing.py), the first disagreement may be a duplicated row inside the experts in forward.
    assert (
        re.search(r"model\.layers\.\d\.mlp\.experts\b", where.message)
        and where.span.line == plan.count("\n", 0, plan.index(": expert_parallel")) + 3
    ), where.message


def _lint_without_step(tmp_path, text: str) -> str:
    """`shardlang lint plan.sl examples/hf_qwen3_moe.py --no-step` on `text`, which has errors: what it prints."""
    path = tmp_path / "plan.sl"
    path.write_text(text)
    done = shardlang_cli("lint", path, QWEN3_MOE, "--no-step", workers=False)
    assert done.returncode == 1, done.stdout + done.stderr
    return done.stdout


def test_expert_parallel_on_what_it_cannot_split_is_sl202(tmp_path):
    """On a module without stacked experts, and on experts that do not divide by the mesh dim."""
    out = _lint_without_step(
        tmp_path,
        "shardlang 1\nmesh world = cpu[tp=3]\nparallelize on world.tp {\n"
        "    model.layers.*.mlp.experts : expert_parallel\n    model.layers.*.mlp.gate : expert_parallel\n}\n",
    )
    assert re.search(
        r"plan\.sl:4:\d+: error\[SL202\] expert_parallel does not apply to 'model\.layers\.0\.mlp\.experts'", out
    )
    assert "its 4 experts do not split evenly over 3 ranks" in out
    assert re.search(
        r"plan\.sl:5:\d+: error\[SL202\] expert_parallel does not apply to 'model\.layers\.0\.mlp\.gate'", out
    )
    assert "stacked on dim 0" in out and "a router stays whole" in out


@pytest.mark.distributed
def test_the_plan_explains_with_its_all_to_alls():
    """explain lays the experts out split by expert and simulates the step (routing taken as uniform)."""
    import shardlang
    from examples.hf_qwen3_moe import build_model, example_input, loss

    with torch.device("meta"):
        model = build_model()

    e = shardlang.load(EP_PLAN).explain(model, world_size=4, example_input=example_input, loss=loss)
    experts = [t for t in e.tensors if t.name == "model.layers.0.mlp.experts.gate_up_proj"]
    assert experts and experts[0].placements[-1] == "S(0)" and experts[0].local_shape[0] == 1  # 4 experts / tp 2 / dp 2
    assert any("all_to_all" in c.op for c in e.collectives), e.collectives
    assert any("routing taken as uniform" in note for note in e.notes), e.notes
    # The experts' eager collectives on tp (the gather of the shared batch) wait for their result: exposed,
    # not FSDP's overlapped ones, which run on dp alone.
    eager_on_tp = [c for c in e.collectives if c.mesh_dim == "world.tp" and c.op.endswith("_")]
    assert "_allgather_base_" in {c.op for c in eager_on_tp}, e.collectives
    assert not any(d.overlapped for d in e.time.dims if d.mesh_dim == "world.tp"), e.time.dims
    assert any(d.overlapped for d in e.time.dims if d.mesh_dim == "world.dp"), e.time.dims


def test_fsdp_over_the_dim_the_experts_are_split_on_is_sl218(tmp_path):
    """A dim that splits the experts cannot also shard units over a 2-D mesh (HSDP): said before any run, at
    the fully_shard block. (`world.ep` alone or `world[dp*ep]` borrows it: tests/test_expert_layouts.py.)"""
    out = _lint_without_step(
        tmp_path,
        "shardlang 1\nmesh world = cpu[dp=2, ep=2]\nparallelize on world.ep {\n    model.layers.*.mlp.experts : expert_parallel\n}\n"
        "fully_shard on world[dp, ep] {\n    each model.layers.*\n}\n",
    )
    assert "plan.sl:6:16: error[SL218] fully_shard on world[dp, ep] spreads over world.ep" in out, out
    assert "the parallelize block: " in out and "plan.sl:3:16" in out


@pytest.mark.distributed
def test_the_benchmark_runs_both_sides_to_the_same_loss_and_collectives():
    """benchmarks/ep_compare.py's dry run (CPU, gloo, a tiny Mixtral): the plan's side and the hand-written
    one start from the same loss and run the same collectives, so what it times is the same work; its
    `--host-ops` profile names the ops only shardlang's side runs (its shared batch's slice)."""
    import json
    import subprocess
    import sys

    from shardlang.launch.workers import free_port

    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
        + ["--master-port", str(free_port())]
        + ["benchmarks/ep_compare.py", "--dry-run", "--steps", "2", "--warmup", "1", "--host-ops", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    sides = ("shardlang", "hand", "hand_dtensor")
    assert len({result["first_loss"][side] for side in sides}) == 1, result["first_loss"]
    counts = {side: result[side]["counts"] for side in sides}
    assert counts["shardlang"]["all_to_all_single"] == counts["hand"]["all_to_all_single"] > 0, counts
    assert counts["shardlang"] == counts["hand"] == counts["hand_dtensor"], counts
    table = done.stdout[done.stdout.index("shardlang - hand, per step") :]
    assert "host ops of shardlang" in done.stdout and "RowSlice" in table.split("hand_dtensor - hand")[0], table


@pytest.mark.distributed
def test_the_printed_program_splits_the_experts_as_apply_does(pools):
    """`compile --emit python` pastes ExpertParallel and what it calls (compiler and torchcompat functions
    among them): the program, run on its own, gives the placements and shards apply gives."""
    from . import dist_jobs

    assert pools(4).run(
        dist_jobs.emitted_code_matches_apply, EP_PLAN.read_text(), "examples.hf_qwen3_moe:build_model", 4
    )[0]


@pytest.mark.distributed
def test_the_printed_program_splits_the_experts_by_width_as_apply_does(pools):
    """The same for ExpertTensorParallel (plans/hf/qwen3_moe.sl: the layout table it reads is pasted too)."""
    from . import dist_jobs

    plan = (ROOT / "plans" / "hf" / "qwen3_moe.sl").read_text()
    assert pools(4).run(dist_jobs.emitted_code_matches_apply, plan, "examples.hf_qwen3_moe:build_model", 4)[0]


@pytest.mark.distributed
def test_the_printed_program_splits_experts_held_as_modules_as_apply_does(pools):
    """The same for experts split by member (plans/field/switch_ep_fsdp.sl: SwitchTransformers' ModuleDict):
    the program drops the members apply drops and shards the rest as apply does."""
    from . import dist_jobs

    plan = (ROOT / "plans" / "field" / "switch_ep_fsdp.sl").read_text()
    assert pools(4).run(dist_jobs.emitted_code_matches_apply, plan, "examples.field.switch:build_model", 4)[0]


BORROWED = ROOT / "plans" / "hf" / "olmoe_ep_fsdp.sl"


def test_a_flattened_mesh_gives_the_experts_their_own_unit_over_what_is_left():
    """`fully_shard on world[dp*ep]` beside expert_parallel on world.ep: the experts get a unit over dp
    with gradients divided by dp*ep, and route their own tokens (the ep ranks train on different data)."""
    import shardlang

    plan = shardlang.load(BORROWED)
    experts, blocks = plan.units
    assert str(experts.mesh) == "world.dp" and str(experts.divide_by) == "world[dp*ep]" and not experts.root
    assert [str(u.target) for u in experts.units] == ["model.layers.*.mlp.experts"]
    assert experts.options == blocks.options and str(blocks.mesh) == "world[dp*ep]" and blocks.mesh.flat
    assert plan.parallelize[0].rules[0].style.get("shared_batch") is False
    # without the flattened block nothing is added
    alone = shardlang.loads(BORROWED.read_text().replace("world[dp*ep]", "world.dp"))
    assert len(alone.units) == 1 and alone.parallelize[0].rules[0].style.get("shared_batch") is None


def test_flattened_mesh_refs_are_checked():
    import shardlang

    def error(text: str) -> str:
        with pytest.raises(shardlang.PlanError) as raised:
            shardlang.loads("mesh world = cpu[dp=2, ep=2]\n" + text)
        (found,) = raised.value.diagnostics
        return f"{found.code} {found.span.line}:{found.span.col} {found.message}"

    assert error("fully_shard on world[ep*dp] { each a }") == (
        "SL102 2:16 world[ep*dp] flattens dims out of the mesh's order"
    )
    assert error("fully_shard on world[dp*dp] { each a }") == "SL102 2:16 world[dp*dp] names a dim twice"
    assert error("parallelize on world[dp*ep] { a : colwise }").startswith(
        "SL102 2:16 a flattened mesh (world[dp*ep]) is for fully_shard and replicate blocks"
    )
    # experts under a class scope: no pattern names them for their own unit
    assert error(
        "parallelize class Block on world.ep { experts : expert_parallel }\nfully_shard on world[dp*ep] { each a }"
    ).startswith("SL102 2:39 the experts of `experts` need their own fully_shard unit over world.dp")
    # a class target is a unit target itself
    plan = shardlang.loads(
        "mesh world = cpu[dp=2, ep=2]\nparallelize on world.ep { class Experts : expert_parallel }\n"
        "fully_shard on world[dp*ep] { each a }"
    )
    assert str(plan.units[0].units[0].target) == "class Experts"


def test_an_ep_dim_a_non_expert_rule_also_splits_cannot_be_borrowed(tmp_path):
    """SL218 stays for a flattened mesh over a dim that a tensor-parallel rule splits as well."""
    text = BORROWED.read_text().replace(
        "model.layers.*.mlp.experts : expert_parallel",
        "model.layers.*.mlp.experts : expert_parallel\n    lm_head : colwise",
    )
    found = {}
    for name, plan in (("both", text), ("clean", BORROWED.read_text())):
        path = tmp_path / f"{name}.sl"
        path.write_text(plan)
        found[name] = shardlang_cli("lint", path, OLMOE, "--no-step", "--world", "4", workers=False)
    assert found["both"].returncode == 1, found["both"].stdout + found["both"].stderr
    assert "error[SL218] fully_shard on world[dp*ep] spreads over world.ep" in found["both"].stdout
    assert found["clean"].returncode == 0 and "SL218" not in found["clean"].stdout, found["clean"].stdout


@pytest.mark.distributed
def test_experts_gradients_not_divided_by_dp_times_ep_fail_the_gradients_check(pools):
    """The plan passes (every check, 4 replicas: dp 2 x ep 2); with the experts' gradients averaged over
    dp alone (each summed over the ep ranks' tokens by the all-to-all's backward), the check fails at them."""
    import shardlang
    from shardlang.launch.job import Job, run

    from . import expert_jobs

    job = Job(str(BORROWED), {}, OLMOE, None, shardlang.load(BORROWED).checks)
    right = pools(4).run(run, job)[0]
    assert right.ok, [(c.check, c.status, c.message) for c in right.checks]
    assert "on 4 replicas" in next(c.message for c in right.checks if c.check == "gradients")
    wrong = pools(4).run(expert_jobs.run_without_divided_expert_gradients, job)[0]
    gradients = next(c for c in wrong.checks if c.check == "gradients")
    assert gradients.status == "fail" and "mlp.experts" in gradients.message, gradients.message


@pytest.mark.distributed
def test_the_printed_program_borrows_the_ranks_as_apply_does(pools):
    from . import dist_jobs

    assert pools(4).run(
        dist_jobs.emitted_code_matches_apply, BORROWED.read_text(), "examples.field.olmoe:build_model", 4
    )[0]


@pytest.mark.distributed
def test_explain_counts_the_borrowed_ranks_and_fits_a_batch():
    """explain of the borrowed layout at world 8 (dp 4 x ep 2): 8 replicas, FSDP's collectives over all the
    ranks and the experts' over dp, the all-to-alls over ep (uniform routing, said so), and --fit."""
    import shardlang
    from examples.field.olmoe import build_model, example_input, loss

    with torch.device("meta"):
        model = build_model()
    e = shardlang.load(BORROWED).explain(model, world_size=8, example_input=example_input, loss=loss, fit=64 * 2**20)
    assert e.peak.replicas == 8
    dims = {d.mesh_dim: d for d in e.time.dims}
    assert dims["world"].group == 8 and dims["world.dp"].group == 4 and dims["world.ep"].group == 2, dims
    assert not dims["world.ep"].overlapped and dims["world.ep"].bytes > 0
    assert {c.op for c in e.collectives if c.mesh_dim == "world.ep"} >= {"all_to_all_single"}, e.collectives
    assert any("routing taken as uniform" in n for n in e.notes)
    assert e.fit.batch > 1 and e.fit.peak <= 64 * 2**20


def test_expert_tensor_parallel_on_what_it_cannot_split_is_sl202(tmp_path):
    """On a router (no stacked experts), and on experts whose width does not divide by the mesh dim."""
    out = _lint_without_step(
        tmp_path,
        "shardlang 1\nmesh world = cpu[tp=3]\nparallelize on world.tp {\n"
        "    model.layers.*.mlp.experts : expert_tensor_parallel\n"
        "    model.layers.*.mlp.gate : expert_tensor_parallel\n}\n",
    )
    assert re.search(r"plan\.sl:4:\d+: error\[SL202\] expert_tensor_parallel does not apply", out)
    assert "intermediate width 32 does not divide by tp=3" in out
    assert re.search(r"plan\.sl:5:\d+: error\[SL202\] expert_tensor_parallel does not apply", out)
    assert "stacked on dim 0 as transformers stores them" in out


@pytest.mark.distributed
def test_explain_of_float32_grouped_experts_says_what_gpus_take(tmp_path):
    """transformers' grouped-matmul experts in float32: explain's step fails as a GPU's would (CUDA's
    torch._grouped_mm takes bf16 only), and its note says so and what to change; with bf16 it steps."""
    text = (
        "shardlang 1\nmesh world = cpu[dp=2, ep=2]\nparallelize on world.ep {\n"
        "    model.layers.*.mlp.experts : expert_parallel\n}\nfully_shard on world.dp {\n    each model.layers.*\n"
    )
    plans = {"fp32": text + "}\n", "bf16": text + "    mixed_precision(param=bf16)\n}\n"}
    notes = {}
    for name, plan in plans.items():
        path = tmp_path / f"{name}.sl"
        path.write_text(plan)
        done = shardlang_cli("explain", path, QWEN3_MOE, "--world", "4", "--format", "json", workers=False)
        assert done.returncode == 0, done.stderr
        notes[name] = " ".join(__import__("json").loads(done.stdout)["notes"])
    assert "takes only bf16 on GPUs" in notes["fp32"] and "mixed_precision(param=bf16)" in notes["fp32"]
    assert "fails" not in notes["bf16"]


@pytest.mark.distributed
def test_a_checkpoint_moves_between_experts_split_by_member_and_whole_ones(tmp_path):
    """SwitchTransformers' experts split by member (each rank saves only the members it holds): saved at
    world 2, the checkpoint loads at world 4 under the same plan (each rank reading only its members) and
    under a plan that keeps every expert on every rank, and back; the gradients check resumes the Adam
    state each time, in the sharded model and in its reference (members gathered from their ranks)."""
    split = str(ROOT / "plans" / "field" / "switch_ep_fsdp.sl")
    whole = tmp_path / "whole.sl"
    whole.write_text(
        "shardlang 1\nmesh world = auto[dp=auto]\nfully_shard on world.dp {\n    each encoder.block.*\n}\n"
    )
    model = str(ROOT / "examples" / "field" / "switch.py")
    first, second = str(tmp_path / "split"), str(tmp_path / "whole")
    runs = [
        (split, "2", "--save", first),
        (split, "4", "--load", first),
        (str(whole), "2", "--load", first),
        (str(whole), "2", "--save", second),
        (split, "4", "--load", second),
    ]
    for plan, world, flag, where in runs:
        done = shardlang_cli("apply", plan, model, "--nproc", world, "--verify", "gradients", flag, where)
        assert done.returncode == 0, (plan, world, flag, done.stdout[-3000:])
        if flag == "--load":
            assert f"resumed Adam state from {where}" in done.stdout, done.stdout[-2000:]
