"""transformers' GptOssForCausalLM (gpt-oss), from a small GptOssConfig: a mixture of experts whose router
has a bias of one element an expert (issue 39). 2 layers, hidden 64, 4 experts (top 2), vocab 128;
eager attention (transformers has no SDPA path for gpt-oss's attention sinks)."""

from transformers import GptOssConfig, GptOssForCausalLM

from examples.families.common import EXPERTS, NO_IDS, SMALL, example_input, loss  # noqa: F401


def build_model() -> GptOssForCausalLM:
    config = GptOssConfig(
        **NO_IDS,
        **{**SMALL, **EXPERTS, "attn_implementation": "eager"},
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    return GptOssForCausalLM(config)
