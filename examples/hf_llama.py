"""Hugging Face transformers' own LlamaForCausalLM, built from a small LlamaConfig: no weights, no
network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 attention heads over 2 key/value heads (grouped-query attention), vocab 128,
float32. The loss is the causal language-model loss on the inputs shifted by one.
"""

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

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
    logits = output.logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), inputs[:, 1:].reshape(-1))
