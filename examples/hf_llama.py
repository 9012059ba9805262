"""Hugging Face transformers' own LlamaForCausalLM, built from a small LlamaConfig: no weights, no
network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 attention heads over 2 key/value heads (grouped-query attention), vocab 128,
float32. The loss is the causal language-model loss on the inputs shifted by one.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from examples.llama import causal_lm_loss

VOCAB, SEQ = 128, 16

#: The small decoder every Hugging Face example model here shares (each adds what its architecture needs).
SMALL = dict(
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


def config() -> LlamaConfig:
    return LlamaConfig(**SMALL)


def build_model() -> LlamaForCausalLM:
    return LlamaForCausalLM(config())


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator)


def loss(output, inputs: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the logits in place (examples/llama.py's causal_lm_loss)."""
    return causal_lm_loss(output.logits, inputs)
