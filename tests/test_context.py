"""Context parallelism's attention (shardlang/runtime/context.py): a sequence split over ranks, plainly or
head-tail balanced, and SDPA on each rank's queries against the gathered keys and values, on CPU (gloo)."""

from __future__ import annotations

import pytest
import torch

from shardlang.runtime.context import join_sequence, sequence_positions, split_sequence

from . import context_jobs


def test_head_tail_gives_each_rank_an_early_and_a_late_chunk():
    assert sequence_positions(8, 2, 0, balanced=True).tolist() == [0, 1, 6, 7]
    assert sequence_positions(8, 2, 1, balanced=True).tolist() == [2, 3, 4, 5]
    assert sequence_positions(8, 2, 1, balanced=False).tolist() == [4, 5, 6, 7]
    x = torch.arange(16).reshape(1, 16)
    for balanced in (True, False):
        shards = [split_sequence(x, 1, 4, r, balanced) for r in range(4)]
        assert torch.equal(join_sequence(shards, 1, balanced), x)
    with pytest.raises(ValueError, match="does not split into 8 equal chunks"):
        sequence_positions(12, 4, 0, balanced=True)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("causal", "balanced"), [(True, True), (True, False), (False, True)])
def test_attention_over_a_split_sequence_equals_the_whole(pools, world, causal, balanced):
    for errors in pools(world).run(context_jobs.attention_matches_whole, causal, balanced):
        assert max(errors.values()) < 1e-12, errors


@pytest.mark.distributed
def test_grouped_query_attention_too(pools):
    for errors in pools(2).run(context_jobs.attention_matches_whole, True, True, True):
        assert max(errors.values()) < 1e-12, errors


@pytest.mark.distributed
def test_unbalanced_shards_under_a_head_tail_mask_are_wrong(pools):
    """The planted fault the checks must catch: shards cut plainly while the mask assumes head-tail."""
    errors = pools(2).run(context_jobs.mask_of_the_other_layout)
    assert min(e["output"] for e in errors) > 1e-3, errors
