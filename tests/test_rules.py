"""Lint rules as a typed protocol: every rule in RULES keeps `Rule`'s signature, and `lint` runs the rules it
is handed (a subset, or the defaults with a user's own added)."""

import inspect

import torch

import shardlang
from examples.mlp import MLP
from shardlang.compiler.lint import lint
from shardlang.compiler.rules import RULES, Rule, unused_dims
from shardlang.frontend.diagnostics import SL209, Diagnostic

# A tp dim the plan uses and a dp dim nothing names: SL217 from `unused_dims`, and only from it.
UNUSED_DIM = """shardlang 1
mesh world = cpu[dp=2, tp=2]
parallelize on world.tp {
    net1 : colwise
    net2 : rowwise
}
"""


def _meta_mlp():
    with torch.device("meta"):
        return MLP()


def test_every_rule_keeps_the_protocol():
    expected = inspect.signature(Rule.__call__).parameters
    expected = [(p.name, p.annotation) for p in expected.values() if p.name != "self"]
    for rule in RULES:
        got = [(p.name, p.annotation) for p in inspect.signature(rule).parameters.values()]
        assert got == expected, rule.__name__
        assert inspect.signature(rule).return_annotation == "list[Diagnostic]", rule.__name__


def test_lint_runs_the_rules_it_is_handed():
    plan = shardlang.loads(UNUSED_DIM)
    model = _meta_mlp()
    assert [d.code for d in lint(plan, model, 4).diagnostics] == ["SL217"]
    assert [d.code for d in lint(plan, model, 4, rules=(unused_dims,)).diagnostics] == ["SL217"]
    assert lint(plan, model, 4, rules=()).diagnostics == ()


def test_a_users_rule_runs_beside_the_defaults():
    seen = []

    def no_bias(plan, resolution, predictions, shapes) -> list[Diagnostic]:
        """A house rule: say which parameters are biases (as a warning code lint already has)."""
        seen.append(dict(shapes))
        return [Diagnostic(SL209.name, f"{fqn} is a bias") for fqn in predictions if fqn.endswith(".bias")]

    plan = shardlang.loads(UNUSED_DIM)
    found = plan.lint(_meta_mlp(), 4, rules=(*RULES, no_bias))
    assert seen == [{"world": (2, 2)}]
    assert sorted(d.message for d in found if d.code == "SL209") == ["net1.bias is a bias", "net2.bias is a bias"]
    assert "SL217" in {d.code for d in found}
