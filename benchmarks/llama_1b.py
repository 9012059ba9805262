"""The ~1B-parameter Llama-style model of the GPU benchmarks: examples/llama.py's structure at dim
2048, 16 layers, 16 heads, FFN 5632, vocabulary 32000, sequence 2048 (0.95B parameters)."""

import torch

from examples.llama import Transformer, loss  # noqa: F401

VOCAB, DIM, HEADS, LAYERS, HIDDEN, SEQ = 32000, 2048, 16, 16, 5632, 2048


def build_model(seq: int = SEQ) -> torch.nn.Module:
    """The model, its rotary table `seq` positions long."""
    return Transformer(vocab=VOCAB, dim=DIM, heads=HEADS, layers=LAYERS, hidden=HIDDEN, seq=seq)


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator)


def flops_per_token() -> float:
    """Training FLOPs per token: 6 per parameter-token and 12 L d s for attention (PaLM's count)."""
    params = VOCAB * DIM * 2 + LAYERS * (4 * DIM * DIM + 3 * DIM * HIDDEN + 2 * DIM) + DIM
    return 6 * params + 12 * LAYERS * DIM * SEQ
