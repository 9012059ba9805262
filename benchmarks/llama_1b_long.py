"""The ~1B Llama of benchmarks/llama_1b.py at a long sequence: 32,768 tokens (its rotary table as long),
for context parallelism (benchmarks/cp_compare.py, benchmarks/plans/llama_1b_cp.sl):

    shardlang explain benchmarks/plans/llama_1b_cp.sl benchmarks/llama_1b_long.py --gpu h200 --batch 1
"""

import torch

from benchmarks import llama_1b
from examples.llama import loss  # noqa: F401

SEQ = 32768


def build_model() -> torch.nn.Module:
    return llama_1b.build_model(SEQ)


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, llama_1b.VOCAB, (batch_size, SEQ), generator=generator)
