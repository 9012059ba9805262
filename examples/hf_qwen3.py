"""Hugging Face transformers' own Qwen3ForCausalLM, built from a small Qwen3Config: no weights, no
network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 attention heads over 2 key/value heads, per-head q/k RMSNorms, vocab 128,
float32. Its rotary table (`model.rotary_emb.inv_freq`) is a non-persistent buffer computed in
__init__: the case `init meta` must keep real.
"""

from transformers import Qwen3Config, Qwen3ForCausalLM

# The same inputs and loss as the Llama example: random token ids, next-token cross-entropy.
from examples.hf_llama import SEQ, VOCAB, example_input, loss  # noqa: F401


def build_model() -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(config)
