"""One dispatch and one combine for every experts form (issue 40, runtime.dispatch): transformers' routed
experts exchange each expert's count and send their rows grouped by expert, as the counted and member forms
do, so each row's expert needs no all-to-all of its own; a rank that receives no row, in a shared batch
too, still gives the unsharded model's gradients."""

from __future__ import annotations

import pytest

from . import dispatch_jobs, expert_jobs
from .conftest import ROOT

pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")

MIXTRAL_EP = ROOT / "plans" / "hf" / "mixtral_ep.sl"
MIXTRAL = str(ROOT / "examples" / "field" / "mixtral.py")


@pytest.mark.distributed
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_one_moe_layer_exchanges_counts_once_and_rows_twice_each_way(pools, implementation):
    """A layer's collectives at world 2: one all-to-all of the counts (c10d's alltoall_base_, the host sync)
    and the rows' there and back in forward and backward (four of the functional all_to_all_single); the
    routed form sent each row's expert in a second all-to-all of the counts' kind before (2 then)."""
    for counts in pools(2).run(dispatch_jobs.collectives_of_one_step, implementation):
        assert counts == {"alltoall_base_": 1, "all_to_all_single": 4}, counts


@pytest.mark.distributed
def test_a_transformers_experts_plan_has_one_all_to_all_a_moe_layer_fewer(tmp_path, pools):
    """plans/hf/mixtral_ep.sl at world 2 (2 MoE layers, the ranks sharing their batch) under `verify comms`:
    10 all-to-alls a step, 5 a layer (12 before: the second exchange of counts, each row's expert, is
    gone), and the gradients check still passes."""
    import shardlang
    from shardlang.launch.job import Job, run

    path = tmp_path / "mixtral_ep.sl"
    path.write_text(
        MIXTRAL_EP.read_text() + "\nverify comms(alltoall_base_=2, all_to_all_single=8), gradients(steps=1)\n"
    )
    job = Job(str(path), {}, MIXTRAL, None, shardlang.load(path).checks)
    report = pools(2).run(run, job)[0]
    checks = {c.check: c for c in report.checks}
    assert checks["comms"].status == "pass", checks["comms"].message
    counts = checks["comms"].data["counts"]
    assert counts["alltoall_base_"] + counts["all_to_all_single"] == 10, counts
    assert checks["gradients"].status == "pass", checks["gradients"].message


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "tokens"), [(2, 7), (4, 7), (4, 3)])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_ranks_that_receive_no_row_in_a_shared_batch(pools, world, tokens, implementation):
    """Every token chooses the experts 0 and 1: at world 2 rank 1, at world 4 ranks 2 and 3, receive no row
    (at 3 tokens over 4 ranks one rank also sends none). The output and every gradient equal the whole
    experts'; the idle ranks' experts have a gradient, zero."""
    results = pools(world).run(dispatch_jobs.idle_ranks_in_a_shared_batch, implementation, tokens)
    for result in results:
        assert max(result["errors"].values()) < 1e-5, result
        assert result["has_grad"], result
    idle = [rank for rank, result in enumerate(results) if not result["received"]]
    assert idle == ([1] if world == 2 else [2, 3]), results


@pytest.mark.distributed
def test_counted_and_member_experts_with_idle_ranks_in_a_shared_batch(pools):
    """The same for the counted form (torchtitan's) and the member form (a ModuleList) at world 4: rows
    every rank holds alike, all of them for the experts of ranks 0 and 1."""
    for errors in pools(4).run(expert_jobs.counted_ep_matches_whole_experts, True, 5, True):
        assert max(errors.values()) < 1e-12, errors
    for errors in pools(4).run(expert_jobs.member_ep_matches_whole_experts, "list", True, 7, True):
        assert max(errors.values()) < 1e-12, errors
