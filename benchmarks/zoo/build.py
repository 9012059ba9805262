"""The zoo's families: transformers' auto mappings enumerated, each family built tiny from its config class
(the generic shrink, a short table of overrides), the model file's example_input and loss, and the probe
that says whether the unsharded model runs at all."""

from __future__ import annotations

import inspect
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[2]
VOCAB, SEQ = 128, 16

#: The kinds of model, in the order a family that several map is taken as: its seq2seq model is what an
#: encoder-decoder is for, a masked LM what an encoder is for (BERT's causal head is a side use).
KINDS = ("seq2seq", "masked", "causal")

#: The generic shrink: (value, every name configs spell it with); a config takes those its constructor has,
#: attribute_map aliases followed.
SHRINK = (
    (64, ("hidden_size", "d_model", "n_embd", "embed_dim", "dim")),
    (
        2,
        (
            "num_hidden_layers",
            "num_layers",
            "n_layer",
            "n_layers",
            "encoder_layers",
            "decoder_layers",
            "num_decoder_layers",
        ),
    ),
    (
        4,
        ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads", "decoder_attention_heads"),
    ),
    (2, ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")),
    (16, ("head_dim", "d_kv", "attention_head_size", "kv_channels")),
    (128, ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner", "ffn_hidden_size")),
    (VOCAB, ("vocab_size",)),
    (SEQ * 4, ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")),
)
#: A mixture of experts' few, narrow experts (examples/families/common.py): 4 of width 32, top 2.
EXPERTS = (
    (4, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")),
    (2, ("num_experts_per_tok", "moe_k", "moe_topk", "top_k", "num_selected_experts")),
    (32, ("moe_intermediate_size", "expert_intermediate_size", "moe_ffn_hidden_size")),
)
#: Multi-head latent attention's ranks and head dims (examples/families/deepseek_v3.py), grouped routing
#: over 4 experts, a rotary dim within head_dim 16.
LATENT = (
    (16, ("kv_lora_rank", "v_head_dim", "rotary_dim")),
    (32, ("q_lora_rank",)),
    (8, ("qk_rope_head_dim", "qk_nope_head_dim")),
    (1, ("n_group", "topk_group")),
)
SPECIAL_IDS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "cls_token_id",
    "decoder_start_token_id",
    "mask_token_id",
    "unk_token_id",
)

#: Per-family overrides where the generic shrink builds nothing that runs (config keyword -> value).
#: Families whose code reads a padding id (RoBERTa's positions from `input_ids.ne(padding_idx)`, a
#: seq2seq shift right) get pad 1, decoder start 2 (BART's).
NEEDS_IDS = dict(pad_token_id=1, decoder_start_token_id=2)
OVERRIDES: dict[str, dict] = {
    name: NEEDS_IDS
    for name in (
        "camembert",
        "data2vec-text",
        "esm",
        "ibert",
        "longformer",
        "m2m_100",
        "nllb-moe",
        "roberta",
        "roberta-prelayernorm",
        "xlm-roberta",
        "xlm-roberta-xl",
        "seamless_m4t",
        "seamless_m4t_v2",
        "led",
        "prophetnet",
        "fsmt",
        "t5gemma",
    )
}
# Kolibri 1.1's indexed attention: at most as many indexer heads as query heads per key head (2 here)
OVERRIDES["kolibri1_1"] = {"index_num_heads": 2, "index_topk": 8, "index_pool_size": 32, "index_compression": 4}
# transformers 5.25: Gemma 4's per-layer input embeddings (a 262k vocabulary each); dots.llm3's MLA needs as
# many key/value heads as query heads
OVERRIDES["gemma4_text"] = {"vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16}
OVERRIDES["dots3_note_text"] = {"num_key_value_heads": 4}
# transformers 5.25: the MLA attentions with a sparse-attention indexer expand keys to every query head, and
# repeat them once more by num_attention_heads // num_key_value_heads; LongCat-Flash's rotary takes head_dim
for name in ("axk2", "deepseek_v32", "glm_moe_dsa"):
    OVERRIDES[name] = {"num_key_value_heads": 4}
OVERRIDES["longcat_flash"] = {"head_dim": 8}
OVERRIDES["dots1"] = {"n_shared_experts": 1}  # its default is None, which its MoE multiplies
OVERRIDES["lfm2_moe"] = {"layer_types": ["conv", "full_attention"]}  # its default is None
# transformers 5.25 validates configs strictly: per-layer patterns must fit the shrunk layer count, Mamba2's
# heads its expanded width, and MPT's attention dropout is an int
OVERRIDES["gpt_neo"] = {"attention_types": [[["global", "local"], 1]]}
OVERRIDES["mamba2"] = {"num_heads": 8}
OVERRIDES["zamba"] = {"num_hidden_layers": 3}  # its hybrid pattern repeats every 3 layers
OVERRIDES["mpt"] = {"attn_config": {"attn_pdrop": 0}}
#: Families whose causal-LM class takes a config of its own (the text half of a multimodal model type).
OWN_CONFIG = frozenset({"qwen3_5_moe", "qwen4_exp"})

#: Families not built, and why (remote code, extra packages, not a language model one can shrink).
NOT_BUILT: dict[str, str] = {
    name: f"a multimodal model type whose per-layer text config the shrink cannot redo; its text model is swept as {name}_text"
    for name in ("gemma4", "dots3_note")
}


@attrs.frozen
class Family:
    """One model_type of transformers' auto mappings: which head class the sweep builds, from which config."""

    name: str
    kind: str  # one of KINDS
    model_class: str
    config_class: str


def families() -> list[Family]:
    """Every model_type transformers maps to a causal, seq2seq or masked LM, each once (KINDS' order)."""
    from transformers.models.auto import configuration_auto, modeling_auto

    mappings = {
        "seq2seq": modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        "masked": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        "causal": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    }
    found: dict[str, Family] = {}
    for kind in KINDS:
        for name, model_class in mappings[kind].items():
            config_class = configuration_auto.CONFIG_MAPPING_NAMES.get(name)
            if name not in found and config_class:
                found[name] = Family(name, kind, _first(model_class), config_class)
    return sorted(found.values(), key=lambda f: f.name)


def _first(names) -> str:
    return names[0] if isinstance(names, (list, tuple)) else names


def family(name: str) -> Family:
    return next(f for f in families() if f.name == name)


def accepted(config_class) -> set[str]:
    """The keywords a config's constructor takes (transformers 5's configs are dataclasses)."""
    return {p for p in inspect.signature(config_class.__init__).parameters if p not in ("self", "kwargs")}


def shrunk(config_class) -> dict:
    """The generic shrink's keywords this config class takes; attribute_map aliases followed."""
    takes, aliases = accepted(config_class), getattr(config_class, "attribute_map", {}) or {}
    kwargs = {}
    for value, names in (*SHRINK, *EXPERTS, *LATENT):
        for name in names:
            real = name if name in takes else aliases.get(name, name)  # the constructor's own name first
            if real in takes:
                kwargs[real] = value
    kwargs.update(special_ids(config_class))
    kwargs.update({name: 0.0 for name in random_knobs(config_class)})
    for name in ("tie_word_embeddings", "use_cache"):
        if name in takes:
            kwargs[name] = False
    return kwargs


def special_ids(config_class) -> dict:
    """No special token ids (defaults such as 50256 lie outside vocab 128; these models only see random
    ids); 0 where the config's type takes no None."""
    parameters = inspect.signature(config_class.__init__).parameters
    return {
        name: None if "None" in str(parameters[name].annotation) else 0 for name in SPECIAL_IDS if name in parameters
    }


def random_knobs(config_class) -> list[str]:
    """Dropout and LayerDrop probabilities and router jitter, numbers a config takes: zero, so that one
    training step of the sharded model and of the reference are the same computation (random masks differ
    by rank)."""
    parameters = inspect.signature(config_class.__init__).parameters.values()
    random = ("dropout", "jitter", "layerdrop")
    return [
        p.name
        for p in parameters
        if (any(word in p.name for word in random) or p.name.endswith("pdrop")) and type(p.default) in (int, float)
    ]


def config_of(fam: Family):
    """The tiny config: the shrink, any sub-config (text, vision, ...) shrunk alike, the family's overrides."""
    import transformers

    config_class = getattr(transformers, fam.config_class)
    if fam.name in OWN_CONFIG:
        config_class = getattr(transformers, fam.model_class).config_class
    kwargs = shrunk(config_class)
    subs = [key for key in getattr(config_class, "sub_configs", None) or {} if key in accepted(config_class)]
    default = config_class() if subs else None
    for key in subs:  # a text, vision or audio config: its default's class (sub_configs may say AutoConfig)
        sub = getattr(default, key, None)
        if isinstance(sub, transformers.PretrainedConfig):
            kwargs[key] = {**per_model(sub.to_dict()), **shrunk(type(sub))}
    takes = accepted(config_class)
    kwargs.update({k: v for k, v in OVERRIDES.get(fam.name, {}).items() if k in takes})
    config = config_class(**kwargs)
    config._attn_implementation = "sdpa" if _has_sdpa(fam) else "eager"
    return config


def per_model(values: dict) -> dict:
    """A default sub-config's values less its per-layer lists (layer_types ...), which the shrunk layer
    count recomputes."""
    layers = values.get("num_hidden_layers")
    return {k: v for k, v in values.items() if not (isinstance(v, list) and layers and len(v) == layers)}


def _has_sdpa(fam: Family) -> bool:
    import transformers

    return bool(getattr(getattr(transformers, fam.model_class), "_supports_sdpa", False))


def build(fam: Family):
    """The family's model, tiny, float32, on the default device."""
    import torch
    import transformers

    model = getattr(transformers, fam.model_class)(config_of(fam))
    if fam.kind == "seq2seq":
        model.register_forward_pre_hook(_decoder_inputs, with_kwargs=True)
    return model.to(torch.float32)


def _decoder_inputs(module, args, kwargs):
    """A seq2seq model is handed the tokens once: the decoder reads the same tokens, so that the loss is the
    causal LM loss on the decoder's logits for every seq2seq family alike."""
    if "decoder_input_ids" not in kwargs and args:
        kwargs = {**kwargs, "decoder_input_ids": args[0]}
    return args, kwargs


def example_input(batch_size: int, generator):
    import torch

    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator)


def causal_loss(output, inputs):
    """Next-token cross-entropy on [batch, seq, vocab] logits (causal LMs and seq2seq decoders)."""
    from examples.llama import causal_lm_loss

    return causal_lm_loss(output.logits, inputs)


def masked_loss(output, inputs):
    """Cross-entropy against the input ids at every position: random ids stand in for masked text."""
    import torch.nn.functional as F

    return F.cross_entropy(output.logits.float().flatten(0, 1), inputs.flatten())


def model_file(name: str):
    """(build_model, example_input, loss) for a generated model file."""
    fam = family(name)
    return (lambda: build(fam)), example_input, masked_loss if fam.kind == "masked" else causal_loss


MODEL_FILE = '''"""transformers' {model_class} ({name}), tiny, from benchmarks/zoo (generated)."""

from benchmarks.zoo import model_file

build_model, example_input, loss = model_file({name!r})
'''


def write_model_file(name: str, path: Path) -> Path:
    """Family `name`'s model file (MODEL_FILE) at `path`: what the sweep and the tests hand shardlang."""
    path.write_text(MODEL_FILE.format(model_class=family(name).model_class, name=name), encoding="utf-8")
    return path


#: A tiny model has well under a million parameters; more means a size the shrink did not reach.
MAX_PARAMETERS = 20_000_000


def probe(fam: Family) -> str | None:
    """None when the family builds and its unsharded model runs a forward and the loss; else why not."""
    import torch

    if fam.name in NOT_BUILT:
        return NOT_BUILT[fam.name]
    try:
        with torch.device("meta"):
            size = sum(p.numel() for p in build(fam).parameters())
        if size > MAX_PARAMETERS:
            return f"the shrink left {size / 1e6:.0f}M parameters (over {MAX_PARAMETERS / 1e6:.0f}M): needs an override"
        torch.manual_seed(0)
        model = build(fam)
        inputs = example_input(2, torch.Generator().manual_seed(0))
        loss = (masked_loss if fam.kind == "masked" else causal_loss)(model(inputs), inputs)
        loss.backward()
    except Exception as e:  # noqa: BLE001 (the family's own code: any failure means "not built")
        return f"{type(e).__name__}: {first_line(str(e))}"[:200]
    return None if torch.isfinite(loss) else f"loss is {loss.item()}"


def first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else ""


def is_moe(fam: Family) -> bool:
    import transformers

    takes = accepted(getattr(transformers, fam.config_class))
    return any(name in takes for _, names in EXPERTS[:1] for name in names)


def applies(fam: Family, mode: str) -> bool:
    """plain and tp for every family; ep where it has experts; cp where its attention is SDPA."""
    return {"ep": is_moe, "cp": _has_sdpa}.get(mode, lambda _: True)(fam)
