"""Hugging Face transformers' own Qwen3MoeForCausalLM, a mixture of experts, built from a small
Qwen3MoeConfig: no weights, no network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 attention heads of 16 over 2 key/value heads with per-head q/k RMSNorms, and in
every layer 4 experts (top 2) of width 32, held as two 3-D tensors of `mlp.experts`: gate_up_proj
[4, 64, 64] and down_proj [4, 64, 32]; vocab 128, float32.

The experts run transformers' default, a grouped matmul (`torch._grouped_mm`), as users' models do. It has
no float64 kernel; the gradients check's float64 truth computes it by one float64 matmul per expert
(shardlang/verification/truth.py).
"""

from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

# The same inputs and loss as the Llama example: random token ids, next-token cross-entropy.
from examples.hf_llama import SEQ, SMALL, VOCAB, example_input, loss  # noqa: F401


def build_model() -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        **SMALL,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        head_dim=16,
    )
    return Qwen3MoeForCausalLM(config)
