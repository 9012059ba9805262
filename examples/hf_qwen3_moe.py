"""Hugging Face transformers' own Qwen3MoeForCausalLM, a mixture of experts, built from a small
Qwen3MoeConfig: no weights, no network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 attention heads of 16 over 2 key/value heads with per-head q/k RMSNorms, and in
every layer 4 experts (top 2) of width 32, held as two 3-D tensors of `mlp.experts`: gate_up_proj
[4, 64, 64] and down_proj [4, 64, 32]; vocab 128, float32.

The experts run transformers' default, a grouped matmul (`torch._grouped_mm`), as users' models do. It has
no float64 kernel; the gradients check's float64 truth computes it by one float64 matmul per expert
(shardlang/verification/truth.py).

Its tensor-parallel plan is transformers 5.24's for Qwen3-MoE, set on the config here: the experts split by
width (`moe_tp_experts`, `shardlang init --tp 2` writes expert_tensor_parallel). transformers 5.25 drops
that style from the model's plan (deprecated in favour of expert parallelism, `--ep`), so the experts would
stay whole on every tp rank; pinning the plan keeps plans/hf/qwen3_moe.sl what init writes on either.
"""

from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

# The same inputs and loss as the Llama example: random token ids, next-token cross-entropy.
from examples.hf_llama import SEQ, SMALL, VOCAB, example_input, loss  # noqa: F401

#: transformers 5.24's Qwen3MoeConfig.base_model_tp_plan.
TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


def build_model() -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        **SMALL,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        head_dim=16,
    )
    config.base_model_tp_plan = TP_PLAN
    return Qwen3MoeForCausalLM(config)
