"""torchtitan's own Llama 3, tiny: fused QKV (`FusedQKVLinear`, whose state-dict hooks save `wqkv` as
`wq`/`wk`/`wv` and merge them on load), SDPA attention (FlexAttention has no CPU backward), and a
build_model that initialises as torchtitan's trainer does, with `init_states()`, whose per-parameter
initialisers (trunc_normal std 0.02, depth-scaled, dim**-0.5 for the output) are not the modules'
`reset_parameters`. `init meta with init_states` calls it on the root, which initialises the whole tree.

torchtitan 0.3 imports triton kernels for expert parallelism at import time; on a machine without
triton they are replaced by a stub module that raises if called (this model calls none)."""

import importlib.util
import sys
import types

import torch

if importlib.util.find_spec("triton") is None:  # torchtitan's MoE kernels; nothing here calls them
    _kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")

    def _unavailable(name):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args, **kwargs):
            raise RuntimeError(f"triton kernel {name} is not available without triton")

        return kernel

    _kernels.__getattr__ = _unavailable
    sys.modules.setdefault(_kernels.__name__, _kernels)

from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import (  # noqa: E402
    _EMBEDDING_INIT,
    _NORM_INIT,
    Llama3Model,
    _build_llama3_layers,
    _output_linear_init,
)

DIM, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 4, 2, 2, 128


def config() -> Llama3Model.Config:
    layers = _build_llama3_layers(
        fuse_qkv=True,
        n_layers=LAYERS,
        dim=DIM,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=32),
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="none"),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=layers,
    )


def build_model() -> torch.nn.Module:
    model = config().build()
    model.init_states()
    return model


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, 16), generator=generator)
