"""torchtitan 0.3.0's own Llama3 8B (`torchtitan.models.llama3.llama3_configs["8B"]`), built as
benchmarks/titan_1b.py builds the 1B (its own SDPA attention, torchtitan's TP layout with sequence
parallelism, RoPE tables cut to the sequence): the 8B-shaped model of issue 43's 8-GPU runs
(`benchmarks/titan_compare.py --size 8b`) and a model file for `shardlang lint|explain|search`.

The 8B: 32 layers, dim 4096, 32 heads over 8 key/value heads, FFN 14336, vocabulary 128256, untied
embedding and output (8.03B parameters), float32 parameters, sequence 2048. `configure(tiny=True)` is the
dry run's size (examples/field/titan_llama3.py's), untied as the 8B is.
"""

from __future__ import annotations

import torch

from benchmarks import titan_1b
from benchmarks.titan_1b import example_input, loss, seq, titan_flops_per_token, vocab, vocab_parallel

__all__ = ["build_model", "configure", "example_input", "flops_per_token", "loss", "seq", "vocab", "vocab_parallel"]


def configure(tiny: bool = False):
    return titan_1b.configure(tiny, size="8B")


def build_model() -> torch.nn.Module:
    """The 8B where the caller's device says (meta for lint and `init meta`), initialised as torchtitan's
    trainer initialises it (`init_states`)."""
    model = configure().build()
    model.init_states()
    return model


def flops_per_token(tiny: bool = False) -> float:
    return titan_flops_per_token(configure(tiny), seq(tiny))
