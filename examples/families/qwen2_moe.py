"""transformers' Qwen2MoeForCausalLM (Qwen2-MoE), from a small Qwen2MoeConfig: stacked experts with a gated
shared expert (issue 39). 2 layers, hidden 64, 4 experts (top 2) of width 32, vocab 128."""

from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from examples.families.common import NO_IDS, SMALL, example_input, loss  # noqa: F401


def build_model() -> Qwen2MoeForCausalLM:
    config = Qwen2MoeConfig(
        **NO_IDS,
        **SMALL,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return Qwen2MoeForCausalLM(config)
