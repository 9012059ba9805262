"""The init check on issue 39's families (class 2: false alarms on correct initialisations; class 6: `init meta
with` a per-module method): each correct plan in tests/fixtures/families/ passes `verify init` at world 2, and
beside it a planted init mistake on the same family fails naming its tensor. Skipped without the extras:
pip install -e '.[hf]' (transformers), '.[titan]' (torchtitan). The check's two statistical rules are also
tested on their own: the scale bound of tensors too small to test in distribution, and identical shards
judged by the unsharded tensor's slices (on a gloo pool, where init meta itself never leaves them alike)."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from shardlang.launch.job import Job, run
from shardlang.verification import init

from .conftest import ROOT

FAMILIES = ROOT / "tests" / "fixtures" / "families"
HAS = {name: importlib.util.find_spec(name) is not None for name in ("transformers", "torchtitan")}
WORLD = 2


def _needs(stem: str):
    needs = "torchtitan" if stem.startswith("titan") else "transformers"
    extra = "titan" if needs == "torchtitan" else "hf"
    return pytest.mark.skipif(not HAS[needs], reason=f"needs {needs}: pip install -e '.[{extra}]'")


def _init_outcome(pools, stem: str):
    """The init check's outcome (status, message) for tests/fixtures/families/STEM.sl at world 2."""
    import shardlang

    plan = FAMILIES / f"{stem}.sl"
    model = re.search(r"^# Model: (\S+)$", plan.read_text(), re.MULTILINE).group(1)
    path, entry = (str(ROOT / model), None) if model.endswith(".py") else (None, model)
    job = Job(str(plan), {}, path, entry, shardlang.load(plan).checks, explicit=True)
    report = pools(WORLD).run(run, job)[0]
    (check,) = [c for c in report.checks if c.check == "init"]
    return check.status, check.message


CORRECT = ["gpt_oss_init_meta", "jamba_init_meta", "modernbert_init_meta", "modernbert_init_weights"]
CORRECT += ["titan_llama3_init_self_parameters"]


@pytest.mark.distributed
@pytest.mark.parametrize("stem", [pytest.param(s, marks=_needs(s), id=s) for s in CORRECT])
def test_a_correct_initialisation_passes(pools, stem):
    status, message = _init_outcome(pools, stem)
    assert status == "pass", message
    if stem.startswith("gpt_oss"):  # the router biases are said to be too small to test, not passed as tested
        assert "too small to test in distribution" in message and "mlp.router.bias" in message, message


#: Each planted mistake, and what its failure must say about which tensor.
PLANTED = {
    "gpt_oss_routers_zeroed": r"model\.layers\.0\.mlp\.router\.bias: root mean square 0,",
    "jamba_a_log_drawn": r"model\.layers\.0\.mamba\.A_log: (mean|standard deviation)",
    "modernbert_decoder_last": r"model\.embeddings\.tok_embeddings\.weight: standard deviation",
    "titan_llama3_reset_parameters": r"layers\.0\.attention\.qkv_linear\.wqkv\.weight: (mean|standard deviation)",
}


@pytest.mark.distributed
@pytest.mark.parametrize("stem", [pytest.param(s, marks=_needs(s), id=s) for s in PLANTED])
def test_a_planted_init_mistake_fails_naming_its_tensor(pools, stem):
    plan = (FAMILIES / f"{stem}.sl").read_text()
    assert re.search(r"^# names: (\S+)$", plan, re.MULTILINE).group(1) in PLANTED[stem].replace("\\", "")
    status, message = _init_outcome(pools, stem)
    assert status == "fail", message
    assert re.search(PLANTED[stem], message), message


def test_a_tensor_too_small_to_test_is_checked_for_scale_only():
    """Four draws of one distribution pass whatever their means (the seed that failed gpt-oss's router bias
    included); zeros, a thousandfold scale and non-finite values do not."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(2000):
        got, want = (torch.empty(4).normal_(std=0.02, generator=generator) for _ in range(2))
        assert init._distribution(got, want) == "", (got, want)
    want = torch.tensor([0.01, -0.03, 0.02, 0.005])
    assert "root mean square 0," in init._distribution(torch.zeros(4), want)
    assert "times apart" in init._distribution(want * 5000, want)
    assert init._distribution(torch.tensor([0.01, float("nan"), 0.0, 0.1]), want) == "not finite"
    low, high = init._rms_bounds(4)  # the bound tightens with the size, below where the distribution is tested
    assert high / low > init._rms_bounds(init.TESTED_FROM - 1)[1] / init._rms_bounds(init.TESTED_FROM - 1)[0]


def test_a_tested_tensor_with_twice_the_std_still_fails():
    generator = torch.Generator().manual_seed(0)
    want = torch.empty(64, 16).normal_(std=0.02, generator=generator)
    got = torch.empty(64, 16).normal_(std=0.04, generator=generator)
    assert "standard deviation" in init._distribution(got, want)


def _identical_shards(rows_alike: bool) -> list[str]:
    """On each rank of a gloo pool: a (4, 8) parameter sharded by rows, every rank's shard filled alike; the
    unsharded tensor's rows are alike (Jamba's A_log) or not. What _duplicated_shards says."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    row = torch.arange(1, 9, dtype=torch.float32).log()
    unsharded = (
        row.expand(4, 8).clone() if rows_alike else torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    )
    alike = torch.full((4 // dist.get_world_size(), 8), 0.5)
    sharded = torch.nn.Parameter(DTensor.from_local(alike, mesh, [Shard(0)]))
    reference = torch.nn.Module()
    reference.register_parameter("A_log", torch.nn.Parameter(unsharded))
    return init._duplicated_shards([("parameter", "A_log", sharded)], reference)


@pytest.mark.distributed
def test_identical_shards_are_judged_by_the_unsharded_slices(pools):
    assert pools(WORLD).run(_identical_shards, True)[0] == []
    found = pools(WORLD).run(_identical_shards, False)[0]
    assert found == ["A_log: ranks 0 and 1 hold identical shards of different parts"], found


def test_a_per_module_method_is_called_below_where_parameters_are_left_unwritten():
    """`calls_below`: parents before children, only where parameters are still unwritten when a module's turn
    comes (a call on a parent that wrote its child's parameters spares the child)."""
    import torch.nn as nn

    from shardlang.compiler.initialisers import calls_below

    class Own(nn.Module):
        def __init__(self, *children, writes_children=False):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2))
            self.writes_children = writes_children
            for i, child in enumerate(children):
                self.add_module(f"c{i}", child)

        def init_self(self):
            done.update(id(p) for p in (self.parameters() if self.writes_children else [self.w]))
            order.append(self)

    leaf_a, leaf_b, leaf_c = Own(), Own(), Own()
    middle, covering = Own(leaf_a, leaf_b), Own(leaf_c, writes_children=True)
    root = Own(middle, covering, nn.Linear(2, 2))
    done, order = {id(root.w)}, []

    def unwritten(module):
        return any(id(p) not in done for p in module.parameters())

    for _, call, subtree in calls_below(root, root, "init_self", unwritten):
        assert subtree
        call()
    assert order == [middle, leaf_a, leaf_b, covering]  # leaf_c written by its parent; a Linear has no init_self
