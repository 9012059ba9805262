"""torchtitan 0.3.0's own Llama3Model, built from its config classes with SDPA attention: a small debug
size (2 layers, dim 64). torchtitan imports triton, which a CPU machine lacks: a stub stands in for it
(no triton kernel runs here)."""

import sys
import types

import torch

try:
    import triton  # noqa: F401
except ImportError:  # only torchtitan's expert-parallel kernels need it; none of them runs here
    _KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
    _stub = types.ModuleType(_KERNELS)
    _stub.__getattr__ = lambda name: None
    sys.modules.setdefault(_KERNELS, _stub)

from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers  # noqa: E402

from examples.llama import causal_lm_loss  # noqa: E402

VOCAB, SEQ, DIM = 128, 16, 64


def build_model() -> Llama3Model:
    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_llama3_layers(
            n_layers=2,
            dim=DIM,
            n_heads=4,
            n_kv_heads=2,
            hidden_dim=128,
            fuse_qkv=False,
            rope=ComplexRoPE.Config(dim=DIM // 4, max_seq_len=SEQ, theta=500000, scaling="none"),
            attn_backend="flex",
        ),
    )
    for layer in config.layers:  # torchtitan's own SDPA inner attention (get_attention_config refuses "sdpa")
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config.build()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator)


def loss(output, inputs):
    """Next-token cross-entropy on the logits in place (torchtitan's model returns the logits themselves)."""
    return causal_lm_loss(output, inputs)
