"""Hugging Face transformers' own MistralForCausalLM, built from a small MistralConfig: no weights, no
network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 attention heads over 2 key/value heads, vocab 128, float32.
"""

from transformers import MistralConfig, MistralForCausalLM

# The same inputs and loss as the Llama example: random token ids, next-token cross-entropy.
from examples.hf_llama import SEQ, SMALL, VOCAB, example_input, loss  # noqa: F401


def build_model() -> MistralForCausalLM:
    config = MistralConfig(**SMALL)
    return MistralForCausalLM(config)
