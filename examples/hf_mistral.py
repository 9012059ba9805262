"""Hugging Face transformers' own MistralForCausalLM, built from a small MistralConfig: no weights, no
network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 attention heads over 2 key/value heads, vocab 128, float32.
"""

from transformers import MistralConfig, MistralForCausalLM

# The same inputs and loss as the Llama example: random token ids, next-token cross-entropy.
from examples.hf_llama import SEQ, VOCAB, example_input, loss  # noqa: F401


def build_model() -> MistralForCausalLM:
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return MistralForCausalLM(config)
