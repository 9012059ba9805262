"""The zoo (issue 41, benchmarks/zoo.py): the sweep finds the families transformers maps, the generic shrink
builds them tiny, and a (family, mode) is judged as the issue counts it: lint against apply, false alarm,
miss, crash. Fast lane: no process is started (the sweep itself is `python benchmarks/zoo.py`). Skipped
without transformers: pip install -e '.[hf]'."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import zoo  # noqa: E402


def test_the_enumeration_finds_every_kind_of_family():
    found = zoo.families()
    kinds = {kind: {f.name for f in found if f.kind == kind} for kind in zoo.KINDS}
    assert len(found) >= 150
    assert {"llama", "qwen3_moe", "jamba"} <= kinds["causal"]
    assert {"bart", "t5"} <= kinds["seq2seq"]  # bart is also a causal and a masked LM: taken as seq2seq
    assert {"bert", "modernbert"} <= kinds["masked"]
    assert len({f.name for f in found}) == len(found)


@pytest.mark.parametrize("name", ["llama", "bart", "bert", "qwen3_moe"])
def test_the_shrink_builds_a_tiny_model(name):
    family = zoo.family(name)
    with torch.device("meta"):
        model = zoo.build(family)
    config = model.config
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert (config.vocab_size, config.hidden_size) == (zoo.VOCAB, 64)
    assert config.num_hidden_layers == 2 and config.num_attention_heads == 4
    assert config.pad_token_id is None
    if name == "qwen3_moe":
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 32)
        assert zoo.is_moe(family) and zoo.applies(family, "ep")
    else:
        assert not zoo.applies(family, "ep")


def test_a_seq2seq_model_reads_the_same_tokens_in_its_decoder():
    torch.manual_seed(0)
    model = zoo.build(zoo.family("bart"))
    inputs = zoo.example_input(2, torch.Generator().manual_seed(0))
    given = model(inputs, decoder_input_ids=inputs).logits
    assert torch.equal(model(inputs).logits, given)
    assert given.shape == (2, zoo.SEQ, zoo.VOCAB)


def _record(lint: str, applied: str, crash: bool = False) -> dict:
    return {
        "built": True,
        "crash": crash,
        "lint": {"verdict": lint, "codes": ["SL220"] if lint == "errors" else [], "said": "raised in 'a.b' at 3"}
        if lint != "crash"
        else {"verdict": "crash", "said": "Traceback"},
        "apply": {"verdict": applied, "checks": {"gradients": applied}, "codes": [], "said": "gradients: 2.5x"},
    }


@pytest.mark.parametrize(
    "lint, applied, crash, outcome, agreement",
    [
        ("clean", "pass", False, "pass", "agree"),
        ("errors", "pass", False, "pass", "false alarm"),
        ("clean", "fail", False, "fail", "miss"),
        ("errors", "fail", False, "fail", "agree"),
        ("clean", "crash", True, "crash", "miss"),
        ("crash", "pass", True, "crash", "lint crash"),
    ],
)
def test_a_record_is_judged_as_the_issue_counts_it(lint, applied, crash, outcome, agreement):
    judged = zoo.judged(_record(lint, applied, crash))
    assert (judged["outcome"], judged["agreement"]) == (outcome, agreement)
    assert (judged["class"] is None) == (outcome == "pass" and agreement == "agree")


def test_a_class_names_the_first_code_with_names_and_numbers_blanked():
    assert zoo.judged(_record("errors", "pass"))["class"] == "lint SL220: raised in '_' at N"
    assert zoo.judged(_record("clean", "fail"))["class"] == "apply gradients: gradients: Nx"
    assert zoo.normalised("model.layers.0.mlp.act_fn.alpha_p: off by 0.203") == "_._: off by N"
    assert zoo.judged({"built": "TypeError: no"})["outcome"] == "not built"


def test_the_planted_mistake_removes_the_first_rowwise_rule_in_the_blocks():
    from benchmarks.zoo.plant import named, planted

    text = "parallelize on world.tp {\n    lm_head : rowwise\n    model.layers.*.self_attn.o_proj : rowwise\n"
    text += "    model.layers.*.mlp.down_proj    : rowwise(output=shard(1))\n}\n"
    wrong, rule = planted(text)
    assert rule == "model.layers.*.self_attn.o_proj" and "o_proj" not in wrong and "down_proj" in wrong
    assert planted("parallelize on world.tp {\n    lm_head : rowwise\n}\n") is None
    assert named(rule, "raises in module 'model.layers.0.self_attn.o_proj' (Linear)")
    assert not named(rule, "raises in module 'model.layers.0.self_attn.o_proj_extra'")
    assert not named(rule, "raises in module 'model.layers.0.self_attn'")


def test_a_pp_starter_is_read_as_pipelined_or_as_init_saying_why_not(tmp_path):
    import json

    from benchmarks.zoo.__main__ import pipelined, table

    assert pipelined("mesh world = auto[pp=2, dp=1]\n\npipeline on world.pp {\n    split model.layers.* into auto\n}\n")
    said = (
        "# --pp 2 asked for, but it has 2 stacks of blocks (model.encoder.layers, model.decoder.layers); init\n"
        "# pipelines one: no pipeline, and so no pp dim (SL217).\nmesh world = auto[dp=auto]\n"
    )
    assert pipelined(said) == "it has N stacks of blocks (_._, _._)"
    assert pipelined("mesh world = auto[dp=auto]\n") == "no pipeline, and no comment saying why"
    results = tmp_path / "results.jsonl"
    passed = {"built": True, "crash": False, "lint": {"verdict": "clean"}, "apply": {"verdict": "pass", "checks": {}}}
    records = [
        {"family": "a", "mode": "pp", **passed, "pipelined": True},
        {"family": "b", "mode": "pp", **passed, "pipelined": pipelined(said)},
        {"family": "c", "mode": "pp", "built": "TypeError: no"},  # not built: no starter to read
    ]
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "pp: 1 of 2 starters pipelined; no pipeline, init saying why: 1 x it has N stacks" in table(results)
