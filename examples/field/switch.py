"""transformers' SwitchTransformersEncoderModel, a mixture of experts held as an nn.ModuleDict of whole
MLPs (`experts.expert_0` ... each a `wi`/`wo` pair of Linears), routed top-1 with an expert capacity.
Needs the optional extra: pip install -e '.[hf]'.

2 blocks, each with a sparse feed-forward of 4 experts (d_model 64, d_ff 128), 4 heads, vocab 128,
float32; no router jitter and no dropout, so that a step is deterministic. The loss is the mean square of
the encoder's last hidden state (the model has no head of its own).
"""

import torch
from transformers import SwitchTransformersConfig, SwitchTransformersEncoderModel

from examples.field.common import SEQ, VOCAB, example_input  # noqa: F401


def build_model() -> SwitchTransformersEncoderModel:
    config = SwitchTransformersConfig(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_heads=4,
        num_layers=2,
        num_sparse_encoder_layers=2,
        num_decoder_layers=0,
        num_sparse_decoder_layers=0,
        num_experts=4,
        expert_capacity=64,
        router_jitter_noise=0.0,
        dropout_rate=0.0,
    )
    return SwitchTransformersEncoderModel(config)


def loss(output, inputs: torch.Tensor) -> torch.Tensor:
    return output.last_hidden_state.float().pow(2).mean()
