"""The right module blamed (issue 39, class 5), on the families where the wrong one was.

- A packed weight split with plain `colwise` (GLM-4's `mlp.gate_up_proj`, ModernBERT's `attn.Wqkv`): its
  output agrees gathered whole, and the first tensor that disagrees is made by the model's own `chunk` or
  `view` after it, as the input of another module. The gradients check names the rule's module, from the
  autograd graph between them, and suggests `packed_colwise` with the part count a replay confirms; the
  plans with `packed_colwise` pass.
- Jamba under `context_parallel`: the Mamba mixer convolves and scans along the sequence that each cp rank
  holds a shard of. The gradients check names the mixer (not the embedding's parameter), and lint says it
  before any run (SL223), while the Llama-style context-parallel plans stay clean.

Each planted fixture's header gives the module it must name (`# names:`) and the style it must suggest
(`# suggests:`). Skipped without the hf extra: pip install -e '.[hf]'.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from .conftest import FIXTURES, ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers: pip install -e '.[hf]'"
)

FAMILIES = FIXTURES / "families"
WORLD = 2  # tp 2 or cp 2: the smallest world that splits anything


def _header(path: Path, key: str) -> str | None:
    found = re.search(rf"^# {key}: (\S.*)$", path.read_text(), re.MULTILINE)
    return found.group(1).strip() if found else None


def _apply(pools, plan: Path):
    import shardlang
    from shardlang.launch.job import Job, run

    job = Job(str(plan), {}, str(ROOT / _header(plan, "Model")), None, shardlang.load(plan).checks)
    return pools(WORLD).run(run, job)[0]


def _localised(report) -> dict:
    failed = [c for c in report.checks if c.status == "fail"]
    assert failed, "missed: every check passed"
    found = [c.data["localised"] for c in failed if (c.data or {}).get("localised")]
    assert found, [c.message for c in failed]
    return found[0]


@pytest.mark.distributed
@pytest.mark.parametrize("planted", ["glm4_colwise_gate_up", "modernbert_colwise_wqkv"])
def test_packed_weight_split_with_colwise_names_its_rule_and_packed_colwise(pools, planted):
    """The chunk (GLM-4) or view (ModernBERT) the model's own code makes of the rule's output is traced back
    to the rule, whose line the finding is placed at, with the part count the replay found."""
    plan = FAMILIES / f"{planted}.sl"
    where = _localised(_apply(pools, plan))
    assert where["module"] == _header(plan, "names")
    assert where["statements"][0]["what"] == "the parallelize rule on it"
    assert "colwise" in where["statements"][0]["text"]
    assert "the model's own code splits" in where["what"]
    assert any(_header(plan, "suggests") in line for line in where["help"]), where["help"]


@pytest.mark.distributed
@pytest.mark.parametrize("correct", ["glm4_packed_gate_up", "modernbert_packed_wqkv"])
def test_packed_weight_with_packed_colwise_passes(pools, correct):
    report = _apply(pools, FAMILIES / f"{correct}.sl")
    assert report.ok, [c.message for c in report.checks if c.status != "pass"]


@pytest.mark.distributed
def test_jamba_under_context_parallel_names_the_mamba_mixer(pools):
    """Each cp rank's Mamba mixer convolves and scans its own shard alone: named, at context_parallel."""
    plan = FAMILIES / "jamba_cp.sl"
    where = _localised(_apply(pools, plan))
    assert where["module"] == _header(plan, "names")
    assert where["class"] == "JambaMambaMixer"
    assert where["statements"][0]["text"].startswith("context_parallel")


def _context_mixing(plan: Path, model_path: str):
    import shardlang
    from shardlang.compiler.lint import lint
    from shardlang.compiler.rules.positions import context_mixing
    from shardlang.runtime.modelfile import load_model_file

    model_file = load_model_file(str(ROOT / model_path))
    with torch.device("meta"):
        model = model_file.build_model()
    loaded = shardlang.load(plan)
    linted = lint(loaded, model, 4)
    assert linted.ok, [d.message for d in linted.diagnostics]
    return context_mixing(loaded, linted.resolution, model, model_file.example_input)


def test_lint_says_jamba_mixes_positions_outside_the_split_attention():
    plan = FAMILIES / "jamba_cp.sl"
    found = _context_mixing(plan, _header(plan, "Model"))
    assert [d.code for d in found] == ["SL223"]
    assert f"'{_header(plan, 'names')}' (JambaMambaMixer)" in found[0].message
    assert found[0].span.line == 11  # the context_parallel statement


@pytest.mark.parametrize(
    "plan",
    ["plans/llama_cp.sl", "plans/hf/llama_cp.sl", "plans/llama_cp_tp.sl", "plans/llama_cp_pipeline.sl"],
)
def test_lint_leaves_llama_style_context_parallel_plans_clean(plan):
    """Rotary embeddings, norms and MLPs act on each position by itself: no SL223."""
    model = re.search(r"Model: (\S+\.py)", (ROOT / plan).read_text()).group(1)
    assert _context_mixing(ROOT / plan, model) == []


@pytest.mark.parametrize(
    "family, attention",
    [("examples.families.modernbert", "model.layers.0.attn"), ("examples.hf_llama", "model.layers.0.self_attn")],
)
def test_position_mixers_names_attention_that_is_not_split(family, attention):
    """With no attention split, the attention modules mix positions and are named (the test above cannot
    pass by running nothing), while embeddings, rotary embeddings, norms and MLPs are not."""
    import importlib

    from shardlang.compiler.rules.positions import position_mixers

    model_file = importlib.import_module(family)
    torch.manual_seed(0)
    found = position_mixers(
        model_file.build_model(), (model_file.example_input(2, torch.Generator().manual_seed(0)),), ()
    )
    assert attention in found
    assert all(name.rpartition(".")[2] in ("attn", "self_attn") for name in found), found


@pytest.mark.distributed
def test_lint_command_reports_sl223_from_its_step(capsys, monkeypatch):
    """Through `shardlang lint`: SL223 comes with lint's simulated step (beside it, in a forked child)."""
    import json

    from shardlang.cli import main

    monkeypatch.chdir(ROOT)
    plan = "tests/fixtures/families/jamba_cp.sl"
    status = main(["lint", plan, "examples/families/jamba.py", "--world", "4", "--format", "json"])
    found = [(d["code"], d["line"]) for d in json.loads(capsys.readouterr().out)]
    assert (status, found) == (1, [("SL223", 11)])


def test_an_input_is_traced_to_the_outputs_it_was_cut_from_not_those_it_sums_whole():
    """Recording.sources, which the split finding rests on: an input made by a `chunk` of a module's output
    is traced to that module; one that only adds that output whole (a residual) is not, so that a rule
    whose output merely flows into a wrong sum is not blamed for it."""
    from torch import nn

    from shardlang.verification.recording import record

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.packed, self.act, self.proj, self.norm = nn.Linear(4, 8), nn.SiLU(), nn.Linear(4, 4), nn.LayerNorm(4)

        def forward(self, x):
            gate, up = self.packed(x).chunk(2, dim=-1)
            return self.norm(x + self.proj(self.act(gate) * up))

    recording = record(Block(), lambda model, stop: model(torch.randn(2, 4)).sum().backward())
    assert recording.sources("act#1 in 0") == ["packed#1"]
    assert recording.sources("proj#1 in 0") == ["packed#1"]  # up cut from packed; act's output only multiplied
    assert recording.sources("norm#1 in 0") == []  # proj's output and x, summed whole


def test_sl223_not_checked_is_said_in_the_steps_note_not_left_to_read_as_clean(monkeypatch):
    """Where the forked search for position-mixing modules fails or times out, lint says SL223 was not
    checked, instead of reporting nothing (a clean result that compared nothing)."""
    from shardlang.explain import mixing
    from shardlang.explain.rehearsal import Rehearsal

    class Plan:
        context_parallel = object()

    class ModelFile:
        example_input = object()

    monkeypatch.setattr(mixing, "in_fork", lambda fn, timeout_s: ("failed", "timed out after 120 s"))
    found = mixing.with_context_mixing(Rehearsal((), "one training step simulated"), Plan(), None, ModelFile(), None, 1)
    assert found.diagnostics == ()
    assert found.note.endswith("(SL223) was not checked: timed out after 120 s")
