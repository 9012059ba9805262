"""Hugging Face transformers' own Phi3ForCausalLM, built from a small Phi3Config: no weights, no network.
Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 attention heads over 2 key/value heads, vocab 128, float32. Its projections are
fused: `self_attn.qkv_proj` packs [q; k; v] (64 + 32 + 32 rows) and `mlp.gate_up_proj` packs
[gate; up] (128 + 128 rows), which the model splits again after the matmul.
"""

from transformers import Phi3Config, Phi3ForCausalLM

# The same inputs and loss as the Llama example: random token ids, next-token cross-entropy.
from examples.hf_llama import SEQ, SMALL, VOCAB, example_input, loss  # noqa: F401


def build_model() -> Phi3ForCausalLM:
    config = Phi3Config(
        **SMALL,
        original_max_position_embeddings=SEQ,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Phi3ForCausalLM(config)
