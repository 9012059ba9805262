"""Expert parallelism on experts that take their rows grouped by expert with each expert's count
(torchtitan's grouped experts, issue 27): the runtime on a plain-torch module of that convention, which
needs neither transformers nor torchtitan; torchtitan's own Qwen3-MoE runs under plans/field/ and
benchmarks/titan_compare.py --config ep."""

from __future__ import annotations

import pytest
import torch

from shardlang.compiler.predict import stacked_experts, takes_expert_counts

from . import expert_jobs


def test_the_counted_convention_is_told_from_the_routed_one():
    """Two required arguments (rows, counts) is torchtitan's convention; transformers' experts take three
    (hidden_states, top_k_index, top_k_weights), and a module whose forward takes more optional ones still
    counts only what it needs."""

    class Routed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.num_experts = 4
            self.w = torch.nn.Parameter(torch.zeros(4, 2, 2))

        def forward(self, hidden_states, top_k_index, top_k_weights, scale=None):
            return hidden_states

    counted = expert_jobs.CountedExperts()
    assert stacked_experts(counted) == 4 and takes_expert_counts(counted)
    assert stacked_experts(Routed()) == 4 and not takes_expert_counts(Routed())


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shared", [False, True], ids=["own-rows", "shared-rows"])
def test_counted_experts_split_over_ep_equal_whole_ones(pools, world, shared):
    """Each rank's rows (its own, 5 + rank tokens x top 2; or a slice of 5 x 2 rows every rank holds alike,
    uneven at world 4) go to their experts' ranks and back in order: the output, the rows' gradient and
    each rank's experts' gradients equal the whole experts', to float64 rounding."""
    for errors in pools(world).run(expert_jobs.counted_ep_matches_whole_experts, shared):
        assert max(errors.values()) < 1e-12, errors


@pytest.mark.distributed
def test_counted_experts_given_their_counts_as_a_list(pools):
    """JetMoE's experts take the counts as a list of ints (its router's .tolist()): split over ep, they are
    handed their local counts as a list too, and equal the whole experts."""
    for errors in pools(2).run(expert_jobs.counted_ep_matches_whole_experts, False, 5, False, True):
        assert max(errors.values()) < 1e-12, errors


@pytest.mark.distributed
def test_counted_experts_on_a_rank_that_receives_no_row(pools):
    """Every row goes to the experts of rank 0: rank 1 computes on no rows, still takes part in both
    all-to-alls, and its experts get a zero gradient."""
    for errors in pools(2).run(expert_jobs.counted_ep_matches_whole_experts, False, 5, True):
        assert max(errors.values()) < 1e-12, errors


def test_init_writes_expert_parallelism_and_the_root_initialiser_for_torchtitans_moe():
    """`shardlang init --ep 2` on torchtitan's Qwen3-MoE, which carries no transformers ep_plan: the rule
    goes on the modules holding stacked experts (its grouped experts), the ep ranks borrow dp, and `init
    meta with init_states` (torchtitan initialises the model whole; plain `init meta` would leave its
    experts uninitialised, SL209). The plan lints clean against the model at world 4."""
    pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install -e '.[titan]'")
    import shardlang
    from shardlang.compiler.starter import init_plan
    from shardlang.runtime.modelfile import load_model_file

    from .conftest import ROOT

    with torch.device("meta"):
        model = load_model_file(str(ROOT / "examples" / "field" / "titan_qwen3_moe.py")).build_model()
    text = init_plan(model, ep=2)
    assert "mesh world = auto[dp=auto, ep=2]" in text
    assert "    layers.*.moe.routed_experts.inner_experts : expert_parallel" in text
    assert "fully_shard on world[dp*ep] {" in text and "init meta with init_states" in text
    diagnostics = shardlang.loads(text).lint(model, world_size=4)
    assert not [d for d in diagnostics if d.is_error or d.code == "SL209"], [str(d.message) for d in diagnostics]


def test_init_without_stacked_experts_keeps_saying_why_there_is_no_ep_dim():
    """A model with neither an ep_plan nor stacked experts: no ep dim, and the comment says both."""
    from shardlang.compiler.starter import init_plan

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    text = init_plan(model, ep=2)
    assert "mesh world = auto[dp=auto]" in text and "no module holds" in text and "init meta\n" in text
