"""The gradients check's floor for gradients of a few values (verification/gradients.py): the same parameter
in every block shares the largest rounding error of any of them, whatever the block's path."""

from __future__ import annotations

import torch

from shardlang.frontend.patterns import starred
from shardlang.verification.gradients import _few_values_floors
from shardlang.verification.reference import K


def test_starred_stars_every_integer_segment():
    assert starred("layers.0.attention.wq") == "layers.*.attention.wq"
    assert starred("0.weight") == "*.weight"  # a Sequential root's blocks
    assert starred("layers.1.experts.3.scale") == "layers.*.experts.*.scale"  # both, not the first alone
    assert starred("layers.10") == "layers.*" and starred("h2o.w1") == "h2o.w1"


class _References:
    """What _few_values_floors reads: the truth and the same-precision copy, with gradients."""

    def __init__(self, truth, same):
        self.truth, self.same = truth, same

    def not_finite(self):
        return frozenset()


def _net(errors):
    """A Sequential of blocks, each a one-value scale inside a ModuleList of two, its gradient set."""
    net = torch.nn.Sequential(
        *(torch.nn.ModuleList(torch.nn.Linear(1, 1, bias=False) for _ in range(2)) for _ in range(2))
    )
    net.double()
    for (i, j), error in errors.items():
        net[i][j].weight.grad = torch.full((1, 1), 1.0 + error, dtype=torch.float64)
    return net


def test_a_parameter_of_a_few_values_is_floored_by_its_kind_in_every_block():
    """`0.1.weight` rounds by 1e-3 in its block; every `*.*.weight` may then differ by K times that, the
    blocks of a Sequential root and their nested lists alike (a middle-segment pattern left `0.` and `.1`
    unstarred, and each floor its own)."""
    truth = _net({(i, j): 0.0 for i in range(2) for j in range(2)})
    same = _net({(0, 0): 1e-6, (0, 1): 1e-3, (1, 0): 0.0, (1, 1): 1e-9})
    floors = _few_values_floors(_References(truth, same))
    assert set(floors) == {f"{i}.{j}.weight" for i in range(2) for j in range(2)}
    assert all(abs(floor - K * 1e-3) < K * 1e-9 for floor in floors.values()), floors
