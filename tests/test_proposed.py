"""The tensor-parallel rules `shardlang init --tp N` proposes from a model's structure when it carries no TP
plan of its own (compiler.proposed, issue 41): which rules on the repository's plain models, the comments
where a rule would not fit, and never a split that does not divide. Fast lane but for the last test, which
runs init (lint's step and apply at world 4) and then lint and apply on what it wrote."""

from __future__ import annotations

import pytest
import torch.nn as nn

from examples import llama, mlp
from shardlang.compiler.proposed import proposed_tp_groups, proposed_tp_rules, with_partners
from shardlang.compiler.starter import block_stacks, init_plan
from shardlang.frontend.patterns import modules_matching


def _proposed(model: nn.Module, tp: int = 2) -> list[tuple[str, str | None]]:
    return [(key, ours) for key, _, ours, _ in proposed_tp_rules(model, block_stacks(model), tp)]


def _kept(model: nn.Module, tp: int = 2) -> list[tuple[str, str]]:
    return [(key, ours) for key, ours in _proposed(model, tp) if ours is not None]


def _comments(model: nn.Module, tp: int = 2) -> dict[str, str]:
    return {key: why for key, _, ours, why in proposed_tp_rules(model, block_stacks(model), tp) if ours is None}


LLAMA = [
    ("layers.*.attention.{wq,wk,wv}", "colwise"),
    ("layers.*.attention.wo", "rowwise"),
    ("layers.*.feed_forward.{w1,w3}", "colwise"),
    ("layers.*.feed_forward.w2", "rowwise"),
    ("tok_embeddings", "rowwise(input=replicate)"),
    ("output", "colwise_gather_output"),
]


def test_examples_llama_gets_the_rules_of_plans_llama_2d_without_sequence_parallelism():
    assert _proposed(llama.build_model()) == LLAMA


def test_examples_mlp_gets_the_rules_of_plans_mlp_tp():
    """No stack, no names to go by: net1 widens 16 -> 32 and net2 narrows back, so net1 is the up."""
    assert _proposed(mlp.build_model()) == [("net1", "colwise"), ("net2", "rowwise")]


class _Named(nn.Module):
    def __init__(self, first: str, second: str, width: int):
        super().__init__()
        setattr(self, first, nn.Linear(16, width))
        setattr(self, second, nn.Linear(width, 16))


@pytest.mark.parametrize(
    "mlp, up, down",
    [
        (nn.Sequential(nn.Linear(16, 4), nn.ReLU(), nn.Linear(4, 16)), "0", "2"),  # a bottleneck runs 0 then 2
        (_Named("fc2", "fc1", 16), "fc1", "fc2"),  # square and declared down first: the names tell
        (_Named("w_in", "fc2", 32), "w_in", "fc2"),
    ],
)
def test_an_mlps_down_projection_is_the_one_that_runs_last(mlp, up, down):
    assert _proposed(mlp) == [(up, "colwise"), (down, "rowwise")]


def test_torchtitans_llama3_gets_its_nested_projections():
    """torchtitan's GQAttention holds q, k and v inside its qkv_linear; 4 heads and 2 kv heads split over 2."""
    titan = pytest.importorskip("examples.titan_llama3")
    model = titan.build_model()
    assert _proposed(model) == [
        ("layers.*.attention.qkv_linear.{wq,wk,wv}", "colwise"),
        ("layers.*.attention.wo", "rowwise"),
        ("layers.*.feed_forward.{w1,w3}", "colwise"),
        ("layers.*.feed_forward.w2", "rowwise"),
        ("tok_embeddings", "rowwise(input=replicate)"),
        ("lm_head", "colwise_gather_output"),
    ]
    # 2 kv heads do not split over 4: the attention stays whole, with a comment; the MLP still splits
    assert "2 kv heads do not split over tp=4" in _comments(model, 4)["layers.*.attention"]
    assert ("layers.*.feed_forward.w2", "rowwise") in _kept(model, 4)


class _Attention(nn.Module):
    """A GQA attention saying its head counts as attributes, as torchtitan's and many codebases' do."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = heads, kv_heads
        self.q_proj = nn.Linear(dim, heads * head_dim)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim)
        self.o_proj = nn.Linear(heads * head_dim, dim)


class _Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, head_dim, hidden):
        super().__init__()
        self.self_attn = _Attention(dim, heads, kv_heads, head_dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


class _Model(nn.Module):
    def __init__(self, dim=24, heads=4, kv_heads=2, head_dim=6, hidden=48, vocab=64):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Block(dim, heads, kv_heads, head_dim, hidden) for _ in range(2))
        self.lm_head = nn.Linear(dim, vocab, bias=False)


def _splits_evenly(model: nn.Module, key: str, style: str, tp: int) -> bool:
    """Whether every module a proposed rule names splits its sharded dim by tp."""
    for fqn in modules_matching(model, key):
        module = model.get_submodule(fqn)
        if isinstance(module, nn.Embedding):
            size = module.num_embeddings
        else:
            size = module.in_features if style.startswith("rowwise") else module.out_features
        if size % tp:
            return False
    return True


@pytest.mark.parametrize(
    "sizes, tp, left_whole",
    [
        (dict(heads=3, kv_heads=3, head_dim=8), 2, {"attention"}),  # odd heads
        (dict(heads=4, kv_heads=1, head_dim=6), 2, {"attention"}),  # one kv head (multi-query)
        (dict(heads=6, kv_heads=2, head_dim=4), 4, {"attention"}),  # 6 heads over 4, though 24 splits
        (dict(hidden=50), 4, {"attention", "mlp"}),  # kv heads and hidden width over 4
        (dict(vocab=66), 4, {"attention", "vocabulary"}),  # the vocabulary over 4
        (dict(), 2, set()),
    ],
)
def test_nothing_uneven_is_proposed(sizes, tp, left_whole):
    model = _Model(**sizes)
    kept, comments = _kept(model, tp), _comments(model, tp)
    assert all(_splits_evenly(model, key, style, tp) for key, style in kept), kept
    assert ("layers.*.self_attn" in comments) == ("attention" in left_whole), comments
    assert ("layers.*.mlp.2" in comments) == ("mlp" in left_whole), comments
    assert ("embed_tokens" in comments and "lm_head" in comments) == ("vocabulary" in left_whole), comments
    if not left_whole:
        assert _kept(model, tp) == [
            ("layers.*.self_attn.{q_proj,k_proj,v_proj}", "colwise"),
            ("layers.*.self_attn.o_proj", "rowwise"),
            ("layers.*.mlp.0", "colwise"),
            ("layers.*.mlp.2", "rowwise"),
            ("embed_tokens", "rowwise(input=replicate)"),
            ("lm_head", "colwise_gather_output"),
        ]


def test_a_tied_output_is_found_by_its_weight_and_a_tie_no_rule_places_keeps_both_whole():
    model = _Model()
    model.decoder_out, model.aux = nn.Linear(24, 64, bias=False), model.lm_head  # two layers to the vocabulary
    del model.lm_head
    model.decoder_out.weight = model.embed_tokens.weight
    assert _kept(model)[-2:] == [("embed_tokens", "rowwise(input=replicate)"), ("decoder_out", "colwise_gather_output")]
    model.layers[0].shared = nn.Linear(24, 64, bias=False)
    model.layers[0].shared.weight = model.embed_tokens.weight
    assert "also layers.0.shared's" in _comments(model)["embed_tokens"]


def test_embeddings_tied_to_one_weight_all_get_the_rule():
    """T5's `shared` and its encoder's and decoder's `embed_tokens`: three modules, one weight."""
    model = _Model()
    model.encoder_embed_tokens, model.decoder_embed_tokens = nn.Embedding(64, 24), nn.Embedding(64, 24)
    model.encoder_embed_tokens.weight = model.decoder_embed_tokens.weight = model.embed_tokens.weight
    model.lm_head.weight = model.embed_tokens.weight
    vocabulary = [(key, style) for key, style in _kept(model) if "layers" not in key]
    assert vocabulary == [
        ("embed_tokens", "rowwise(input=replicate)"),
        ("encoder_embed_tokens", "rowwise(input=replicate)"),
        ("decoder_embed_tokens", "rowwise(input=replicate)"),
        ("lm_head", "colwise_gather_output"),
    ]


def test_a_list_of_one_class_is_left_to_ep_and_a_list_of_several_is_structure():
    """Two MLPs of one class in a ModuleList are experts (a rule on the first would miss the second); T5's
    `layer` list (attention, MLP) is how a block is laid out."""
    model = _Model()
    for block in model.layers:
        block.experts = nn.ModuleList(nn.Sequential(nn.Linear(24, 48), nn.Linear(48, 24)) for _ in range(2))
        block.layer = nn.ModuleList([block.self_attn, block.mlp])
        del block.self_attn, block.mlp
    assert _kept(model)[:4] == [
        ("layers.*.layer.0.{q_proj,k_proj,v_proj}", "colwise"),
        ("layers.*.layer.0.o_proj", "rowwise"),
        ("layers.*.layer.1.0", "colwise"),
        ("layers.*.layer.1.2", "rowwise"),
    ]
    assert not [key for key, _ in _proposed(model) if "experts" in key]


def test_an_attention_whose_heads_cannot_be_told_stays_whole():
    model = _Model()
    for block in model.layers:
        del block.self_attn.n_heads, block.self_attn.n_kv_heads
    assert "head size could not be read" in _comments(model)["layers.*.self_attn"]
    assert ("layers.*.mlp.0", "colwise") in _kept(model)


def test_a_per_head_norm_is_replicated_and_a_full_width_one_rules_the_attention_out():
    """Qwen3's q_norm/k_norm (one head's width) see only their rank's heads: their gradients are summed over
    tp. OLMo2's (the whole q width) would normalise a shard as if it were the whole: no proposal."""
    model = _Model()
    for block in model.layers:
        block.self_attn.q_norm, block.self_attn.k_norm = nn.RMSNorm(6), nn.RMSNorm(6)
    assert ("layers.*.self_attn.q_norm", "replicated_with_grad_allreduce") in _kept(model)
    for block in model.layers:
        block.self_attn.q_norm = nn.RMSNorm(24)
    assert "neither a per-head norm's nor whole" in _comments(model)["layers.*.self_attn"]


def test_a_norm_of_the_model_width_around_the_projections_needs_no_rule():
    """BERT's attention holds `output.LayerNorm` beside its output projection, on whole activations: the
    attention is split and the norm left as it is; beside q, k and v (OLMo2's q_norm) it rules it out."""
    model = _Model()
    for block in model.layers:
        attention = block.self_attn
        attention.output = nn.Module()
        attention.output.dense, attention.output.LayerNorm = attention.o_proj, nn.LayerNorm(24)
        del attention.o_proj
    assert _kept(model)[:2] == [
        ("layers.*.self_attn.{q_proj,k_proj,v_proj}", "colwise"),
        ("layers.*.self_attn.output.dense", "rowwise"),
    ]


class _WholeCountAttention(_Attention):
    def forward(self, x):
        """As OPT's: the -1 takes whatever the whole head count leaves, a rank's half of the sequence."""
        q = self.q_proj(x).view(x.shape[0], -1, self.n_heads, 6)
        return self.o_proj(q.flatten(2))


def test_an_attention_reading_its_whole_head_count_stays_whole():
    model = _Model()
    for block in model.layers:
        block.self_attn = _WholeCountAttention(24, 4, 2, 6)
    assert "reads self.n_heads, the whole count" in _comments(model)["layers.*.self_attn"]


def test_a_norm_per_head_rules_the_attention_out():
    """StableLM's q_layernorm holds one norm per head and applies them by position: on a rank holding
    heads 2 and 3 it would apply the norms of heads 0 and 1."""
    model = _Model()
    for block in model.layers:
        block.self_attn.q_layernorm = nn.ModuleList(nn.LayerNorm(6) for _ in range(4))
    assert "one of a norm per head" in _comments(model)["layers.*.self_attn"]


def test_a_packed_qkv_and_a_conv1d_are_comments():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    comments = _comments(transformers.GPT2LMHeadModel(config))
    assert "packed in one weight" in comments["transformer.h.*.attn.c_attn"]
    assert "Conv1D" in comments["transformer.h.*.mlp.c_fc"] and "Conv1D" in comments["transformer.h.*.mlp.c_proj"]


def test_init_plan_writes_the_proposed_rules_under_their_own_comment():
    text = init_plan(llama.build_model(), tp=2, name="llama")
    assert "mesh world = auto[dp=auto, tp=2]" in text
    assert "proposed from the model's structure (it carries no tp_plan of its own)" in text
    assert "    layers.*.attention.{wq,wk,wv} : colwise\n" in text and "    output                        : " in text


def test_init_plan_keeps_the_comment_when_nothing_proposed_fits():
    """At tp=3 nothing in examples/llama.py splits (4 heads, width 64, vocabulary 64): no tp dim, and each
    rule it would have proposed is a comment saying why."""
    text = init_plan(llama.build_model(), tp=3, name="llama")
    assert "mesh world = auto[dp=auto]" in text and "parallelize on" not in text
    said = " ".join(line.lstrip("# ") for line in text.splitlines())
    assert "no tp_plan of its own and no rule proposed from its structure fits it" in said
    assert "#     layers.*.feed_forward.w2 : structure: its hidden width 64 does not split over tp=3" in text


def test_a_rule_left_out_takes_its_group_with_it():
    """Falcon adds in place to its MLP's row-wise output, a view: lint's step leaves out the down projection,
    and the up projection goes with it (alone it would hand the down a split activation); the attention,
    another group, stays. An untied embedding and output layer are each a group of their own."""
    from shardlang.compiler.dropping import Drops

    why = "raises in module 'layers.0' (TransformerBlock), in its forward: RuntimeError: ... modified inplace"
    text = init_plan(llama.build_model(), tp=2, name="llama", drops=Drops(rules={"layers.*.feed_forward.w2": why}))
    assert (
        "    # layers.*.feed_forward.{w1,w3} : structure: left out (lint's simulated step: it runs only with " in text
    )
    assert "    layers.*.attention.wo         : rowwise\n" in text and "    output                        : " in text
    groups = proposed_tp_groups(llama.build_model(), ("layers",), 2)
    assert with_partners(groups, {"output": "why"}) == {"output": "why"}


@pytest.mark.distributed
def test_init_tp2_on_examples_llama_lints_clean_and_applies_at_world_4(tmp_path, capsys):
    """What init --tp 2 writes for examples/llama.py (its own lint with the step, and apply at world 4 with
    every check), then linted again with the step and applied by `shardlang apply` as a user would."""
    from shardlang.cli.main import main

    plan = tmp_path / "llama_tp2.sl"
    assert main(["init", "examples/llama.py", "--tp", "2", "-o", str(plan)]) == 0
    assert "linted clean and applied at world 4 on CPU" in capsys.readouterr().out
    text = plan.read_text()
    assert all(f"    {key} " in text for key, _ in LLAMA) and "left out" not in text
    assert main(["lint", str(plan), "examples/llama.py", "--world", "4"]) == 0
    capsys.readouterr()
    assert main(["apply", str(plan), "examples/llama.py", "--nproc", "4", "--device", "cpu"]) == 0
