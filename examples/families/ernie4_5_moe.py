"""transformers' Ernie4_5_MoeForCausalLM (ERNIE-4.5-MoE), from a small Ernie4_5_MoeConfig: a mixture of
experts whose router weight and score-correction bias transformers keeps in float32 under any dtype
(`_keep_in_fp32_modules_strict`), with a shared expert (issue 39). 2 layers, hidden 64, 4 experts (top 2)."""

from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

from examples.families.common import EXPERTS, NO_IDS, SMALL, example_input, loss  # noqa: F401


def build_model() -> Ernie4_5_MoeForCausalLM:
    config = Ernie4_5_MoeConfig(
        **NO_IDS,
        **SMALL,
        moe_intermediate_size=32,
        moe_num_experts=4,
        moe_k=2,
        moe_num_shared_experts=1,
        moe_layer_start_index=0,
    )
    return Ernie4_5_MoeForCausalLM(config)
