"""transformers' DeepseekV3ForCausalLM (DeepSeek-V3), from a small DeepseekV3Config: multi-head latent
attention and a mixture of experts with group-limited routing and a shared expert (issue 39). 2 layers, the
first dense, hidden 64, 4 experts (top 2) in 2 groups."""

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from examples.families.common import NO_IDS, SMALL, example_input, loss  # noqa: F401


def build_model() -> DeepseekV3ForCausalLM:
    config = DeepseekV3Config(
        **NO_IDS,
        **SMALL,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )
    return DeepseekV3ForCausalLM(config)
