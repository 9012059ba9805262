"""transformers' OlmoeForCausalLM (OLMoE), a mixture of experts whose attention normalises q and k over
their full width, from a small OlmoeConfig (issue 23's field bed): no weights, no network. Needs the
optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 heads over 2 key/value heads, q_norm and k_norm RMSNorms of width 64 and 32 (all
heads at once, so tensor parallelism must hand them the whole q and k), in every layer 4 experts (top 2)
of width 32 in transformers' default grouped-matmul implementation; vocab 128, float32.
"""

from transformers import OlmoeConfig, OlmoeForCausalLM

from examples.field.common import NO_IDS, SEQ, SMALL, VOCAB, example_input, loss  # noqa: F401


def build_model() -> OlmoeForCausalLM:
    config = OlmoeConfig(**NO_IDS, **{**SMALL, "intermediate_size": 32}, num_experts=4, num_experts_per_tok=2)
    return OlmoeForCausalLM(config)
