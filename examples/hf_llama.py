"""Hugging Face transformers' own LlamaForCausalLM, built from a small LlamaConfig: no weights, no
network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 attention heads over 2 key/value heads (grouped-query attention), vocab 128,
float32. The loss is the causal language-model loss on the inputs shifted by one.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from examples.llama import causal_lm_loss
from examples.small import SEQ, SMALL, VOCAB  # noqa: F401 - the sizes the HF examples share


def config() -> LlamaConfig:
    return LlamaConfig(**SMALL)


def build_model() -> LlamaForCausalLM:
    return LlamaForCausalLM(config())


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator)


def loss(output, inputs: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the logits in place (examples/llama.py's causal_lm_loss)."""
    return causal_lm_loss(output.logits, inputs)
