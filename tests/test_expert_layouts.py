"""Experts that borrow data-parallel ranks at every size of every dim (issue 39, class 4): a data dim of size
1 (`world[dp*ep]` with dp=1), ep the only data dim (`fully_shard on world.ep`), and replicate, which cannot
borrow them (SL218). On Qwen2-MoE (examples/families) and the field Mixtral, each layout against a planted
mistake that must still fail at the experts."""

from __future__ import annotations

import pytest

from . import expert_jobs
from .conftest import ROOT, shardlang_cli

pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")

QWEN2_MOE = str(ROOT / "examples" / "families" / "qwen2_moe.py")
MIXTRAL = str(ROOT / "examples" / "field" / "mixtral.py")

EXPERTS = """parallelize on world.ep {
    model.layers.*.mlp.experts : expert_parallel
}
"""

#: Mixtral's attention and its ends tensor parallel, as plans/field/mixtral.sl has them.
MIXTRAL_TP = """parallelize on world.tp {
    model.layers.*.self_attn.q_proj : colwise
    model.layers.*.self_attn.k_proj : colwise
    model.layers.*.self_attn.v_proj : colwise
    model.layers.*.self_attn.o_proj : rowwise
    lm_head                         : colwise_gather_output
    model.embed_tokens              : rowwise(input=replicate)
}
"""


def _plan(mesh: str, data: str, tp: bool = False, extra: str = "") -> str:
    """A plan: `mesh world = auto[MESH]`, the experts split over ep (with `extra` rules in that block), and
    every layer under `DATA` (`fully_shard on world[dp*ep]`, ...); Mixtral's TP rules with `tp`."""
    experts = EXPERTS.replace("expert_parallel\n", f"expert_parallel\n{extra}")
    return (
        f"shardlang 1\n\nmesh world = auto[{mesh}]\n\n{MIXTRAL_TP if tp else ''}{experts}\n"
        f"{data} {{\n    each model.layers.*\n}}\n\nverify placements, gradients(steps=1)\n"
    )


def _lint(tmp_path, text: str, model: str = QWEN2_MOE, world: int = 4):
    path = tmp_path / "plan.sl"
    path.write_text(text)
    return shardlang_cli("lint", path, model, "--no-step", "--world", str(world), workers=False)


def test_fully_shard_over_the_ep_dim_alone_borrows_it_as_world_dp_times_ep_with_dp_of_one():
    """SPEC §12: `fully_shard on world.ep`, ep the only data dim, is the dp=1 layout: the mesh gets a dp dim
    of size 1, outermost, which the experts' unit is over, with gradients divided by ep; the experts route
    their own tokens. A dp of size 1 the plan declares itself is used as it is."""
    import shardlang

    plan = shardlang.loads(_plan("ep=4", "fully_shard on world.ep"))
    assert [(d.name, d.size) for d in plan.meshes[0].dims] == [("dp", 1), ("ep", 4)]
    experts, layers = plan.units
    assert str(experts.mesh) == "world.dp" and str(experts.divide_by) == "world.ep" and not experts.root
    assert [str(u.target) for u in experts.units] == ["model.layers.*.mlp.experts"]
    assert str(layers.mesh) == "world.ep" and layers.divide_by is None
    assert plan.parallelize[0].rules[0].style.get("shared_batch") is False
    declared = shardlang.loads(_plan("dp=1, ep=4", "fully_shard on world.ep"))
    assert [(d.name, d.size) for d in declared.meshes[0].dims] == [("dp", 1), ("ep", 4)]
    # a mesh with a dp of its own, larger than 1, keeps it (an unused dim, SL217) and gets a dim of size 1
    other = shardlang.loads(_plan("dp=2, ep=2", "fully_shard on world.ep"))
    assert [(d.name, d.size) for d in other.meshes[0].dims] == [("efsdp", 1), ("dp", 2), ("ep", 2)]
    # a tensor-parallel split of ep's ranks is not borrowed: no unit, the experts share their batch
    shared = shardlang.loads(_plan("dp=2, ep=2", "fully_shard on world.dp"))
    assert len(shared.units) == 1 and shared.parallelize[0].rules[0].style.get("shared_batch") is None


def test_experts_get_one_unit_whatever_the_number_of_blocks_that_borrow_their_dim(tmp_path):
    """Two fully_shard blocks over the ep dim (or `world[dp*ep]`), the first for the model's ends: the experts
    get one unit, with the options of the block whose unit is above them (not one each, SL201); lint passes."""
    import shardlang

    for mesh, data in (("ep=4", "world.ep"), ("dp=1, ep=4", "world[dp*ep]")):
        ends = f"fully_shard on {data} {{\n    unit model.norm, lm_head\n    root = false\n}}\n\n"
        text = _plan(mesh, f"fully_shard on {data}").replace(
            "    each model.layers.*\n", "    each model.layers.*\n    reshard_after_forward = false\n"
        )
        text = text.replace(f"fully_shard on {data}", ends + f"fully_shard on {data}", 1)
        plan = shardlang.loads(text)
        experts = [b for b in plan.units if b.divide_by is not None]
        assert len(experts) == 1 and [str(u.target) for u in experts[0].units] == ["model.layers.*.mlp.experts"]
        assert dict(experts[0].options)["reshard_after_forward"] is False, experts[0].options
        done = _lint(tmp_path, text)
        assert done.returncode == 0 and "SL201" not in done.stdout, done.stdout + done.stderr
        # experts named by class: no pattern to place them under, the block with the root unit owns them
        by_class = shardlang.loads(text.replace("model.layers.*.mlp.experts :", "class Qwen2MoeExperts :"))
        (experts,) = [b for b in by_class.units if b.divide_by is not None]
        assert [str(u.target) for u in experts.units] == ["class Qwen2MoeExperts"]


def test_lint_takes_fully_shard_over_the_ep_dim_alone_and_keeps_sl218_where_it_cannot_borrow(tmp_path):
    """Not SL218 with only expert_parallel on ep (nor for Mixtral's tp beside it); SL218 at the block's mesh
    where a non-expert rule splits ep too, and for replicate over a flattened mesh with ep in it (DDP would
    average different experts' gradients together), whose help names fully_shard."""
    clean = _lint(tmp_path, _plan("ep=4", "fully_shard on world.ep"))
    assert clean.returncode == 0 and "SL218" not in clean.stdout, clean.stdout + clean.stderr
    mixtral = _lint(tmp_path, _plan("ep=2, tp=2", "fully_shard on world.ep", tp=True), MIXTRAL)
    assert mixtral.returncode == 0 and "SL218" not in mixtral.stdout, mixtral.stdout + mixtral.stderr
    both = _lint(tmp_path, _plan("ep=4", "fully_shard on world.ep", extra="    lm_head : colwise\n"))
    assert both.returncode == 1, both.stdout + both.stderr
    assert "plan.sl:10:16: error[SL218] fully_shard on world.ep spreads over world.ep" in both.stdout, both.stdout
    replicated = _lint(tmp_path, _plan("dp=2, ep=2", "replicate on world[dp*ep]"))
    assert replicated.returncode == 1, replicated.stdout + replicated.stderr
    assert (
        "plan.sl:9:14: error[SL218] replicate on world[dp*ep] cannot borrow world.ep, which expert_parallel "
        "splits the experts over" in replicated.stdout
    ), replicated.stdout
    assert "`fully_shard on world[dp*ep]`" in replicated.stdout and "replicate over world.dp alone" in replicated.stdout


def _job(tmp_path, name: str, text: str, model: str):
    import shardlang
    from shardlang.launch.job import Job

    path = tmp_path / f"{name}.sl"
    path.write_text(text)
    return Job(str(path), {}, model, None, shardlang.load(path).checks)


def _gradients(report):
    return next(c for c in report.checks if c.check == "gradients")


def _passes(report, replicas: int) -> None:
    assert report.ok, [(c.check, c.status, c.message) for c in report.checks]
    assert f"on {replicas} replicas" in _gradients(report).message, _gradients(report).message


def _fails_at_the_experts(report) -> None:
    gradients = _gradients(report)
    assert gradients.status == "fail" and "mlp.experts.gate_up_proj" in gradients.message, gradients.message
    assert next(c for c in report.checks if c.check == "placements").status == "pass"


@pytest.mark.distributed
def test_experts_over_a_data_dim_of_size_one_average_their_gradients_over_every_data_rank(tmp_path, pools):
    """`world[dp*ep]` with dp=1 at world 4 (ep 4) and 2 (ep 2) on Qwen2-MoE: the experts' unit is over one
    rank, and their gradients divided by ep once. Planted: the division set as for a unit over several
    ranks (a factor and, on gloo, a summed reduction), which FSDP2 applies twice on a unit over one rank;
    the gradients check fails at the experts."""
    from shardlang.launch.job import run

    job = _job(tmp_path, "dp1", _plan("dp=1, ep=4", "fully_shard on world[dp*ep]"), QWEN2_MOE)
    _passes(pools(4).run(run, job)[0], 4)
    _fails_at_the_experts(pools(4).run(expert_jobs.run_with_one_rank_units_divided_twice, job)[0])
    two = _job(tmp_path, "dp1_ep2", _plan("dp=1, ep=2", "fully_shard on world[dp*ep]"), QWEN2_MOE)
    _passes(pools(2).run(run, two)[0], 2)


@pytest.mark.distributed
def test_fully_shard_over_the_ep_dim_alone_averages_the_experts_gradients_over_it(tmp_path, pools):
    """`fully_shard on world.ep` at world 4 on Qwen2-MoE: 4 replicas, every check passes, and the printed
    program lays the model out as apply does. Planted: the experts' gradients left undivided (each summed
    over the ep ranks' tokens): the check fails at them."""
    from shardlang.launch.job import run

    from . import dist_jobs

    text = _plan("ep=4", "fully_shard on world.ep")
    job = _job(tmp_path, "ep4", text, QWEN2_MOE)
    _passes(pools(4).run(run, job)[0], 4)
    _fails_at_the_experts(pools(4).run(expert_jobs.run_without_divided_expert_gradients, job)[0])
    # the printed program makes the same mesh, with its dp of size 1, and the same units
    assert pools(4).run(dist_jobs.emitted_code_matches_apply, text, "examples.families.qwen2_moe:build_model", 4)[0]


@pytest.mark.distributed
def test_mixtral_borrows_every_data_rank_beside_tensor_parallelism(tmp_path, pools):
    """The field Mixtral at world 4 with tp 2: `world[dp*ep]` with dp=1 (ep 2) and `fully_shard on
    world.ep` (ep 2), each on 2 replicas."""
    from shardlang.launch.job import run

    for name, data in (("flat", "fully_shard on world[dp*ep]"), ("alone", "fully_shard on world.ep")):
        mesh = "dp=1, ep=2, tp=2" if name == "flat" else "ep=2, tp=2"
        job = _job(tmp_path, name, _plan(mesh, data, tp=True), MIXTRAL)
        _passes(pools(4).run(run, job)[0], 2)


@pytest.mark.distributed
def test_experts_under_replicate_over_the_data_dim_beside_them(tmp_path, pools):
    """`replicate on world.dp` beside expert_parallel on world.ep (the alternative SL218 names for a
    flattened replicate) at world 4 on Qwen2-MoE: the ep ranks share their batch, DDP averages each
    expert's gradient over its dp replicas, and every check passes. Planted: the experts' forward blind to
    the DTensors DDP rebuilds for each forward, which raised at apply before (mixed torch.Tensor and
    DTensor): the run raises there, at the experts' rule."""
    from shardlang.launch.failures import WorkerError
    from shardlang.launch.job import run

    job = _job(tmp_path, "replicate", _plan("dp=2, ep=2", "replicate on world.dp"), QWEN2_MOE)
    _passes(pools(4).run(run, job)[0], 2)
    with pytest.raises(WorkerError, match="mixed torch.Tensor and DTensor") as raised:
        pools(4).run(expert_jobs.run_with_experts_blind_to_replicate, job)
    where = [d.message for d in raised.value.diagnostics]
    assert any("raised in module 'model.layers.0.mlp.experts'" in m for m in where), where
