"""Expert parallelism (issue 27): the expert_parallel runtime on transformers' own stacked experts."""

from __future__ import annotations

import pytest

from . import expert_jobs

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
def test_tokens_combined_without_their_weights_are_wrong(pools):
    """The check above can fail: dropping the routing weights changes the output."""
    assert min(pools(2).run(expert_jobs.ep_without_weights_differs)) > 1e-2


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "tokens"), [(2, 7), (4, 7), (4, 3)])
def test_ranks_that_share_their_tokens_route_one_slice_each(pools, world, tokens):
    """Ranks holding the same tokens (a tensor-parallel dim): each routes its slice (7 tokens over 2 or 4
    ranks: uneven; 3 over 4: one rank has none), and the output and gradients equal the whole experts'
    (sending every token from every rank would count each expert's gradient `world` times)."""
    for errors in pools(world).run(expert_jobs.ep_shared_batch_matches_whole_experts, tokens):
        assert max(errors.values()) < 1e-5, errors
