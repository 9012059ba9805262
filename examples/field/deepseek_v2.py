"""transformers' DeepseekV2ForCausalLM: multi-head latent attention (MLA) and, from the second layer on,
a mixture of experts with a shared expert, from a small DeepseekV2Config (issue 23's field bed): no
weights, no network. Needs the optional extra: pip install -e '.[hf]'.

MLA: q_proj [96, 64] (4 heads of 16 + 8 rotary dims), kv_a_proj_with_mqa [40, 64] compresses the input
to a 32-wide latent plus one 8-dim rotary key that every head shares, kv_a_layernorm, kv_b_proj
[128, 32] expands the latent to each head's key and value, o_proj [64, 64]. Layer 0 is a dense MLP
(width 128), layer 1 has 4 routed experts (top 2, width 32, transformers' default grouped matmul) and
one shared expert. Vocab 128, float32.
"""

from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

from examples.field.common import SEQ, SMALL, VOCAB, example_input, loss  # noqa: F401

#: The latent width: the first KV_LORA_RANK outputs of kv_a_proj_with_mqa, the rotary key after them.
KV_LORA_RANK = 32


def build_model(first_k_dense_replace: int = 1) -> DeepseekV2ForCausalLM:
    config = DeepseekV2Config(
        **{**SMALL, "num_key_value_heads": 4},  # MLA: every head has its own key and value
        q_lora_rank=None,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=first_k_dense_replace,
        n_group=1,
        topk_group=1,
    )
    return DeepseekV2ForCausalLM(config)


def build_dense_model() -> DeepseekV2ForCausalLM:
    """Both layers dense: MLA alone, to judge a plan's attention apart from the experts
    (`--entry examples.field.deepseek_v2:build_dense_model`)."""
    return build_model(first_k_dense_replace=2)
