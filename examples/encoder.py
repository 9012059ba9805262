"""torch's own nn.TransformerEncoder (2 layers of self-attention and feed-forward, d_model 32, 4 heads):
a model whose attention initialises in `_reset_parameters`, not `reset_parameters`.

Model of plans/encoder_fsdp.sl. Run: shardlang apply plans/encoder_fsdp.sl examples/encoder.py --nproc 2
"""

import torch
import torch.nn as nn


def build_model() -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, 8, 32, generator=generator)
