"""torchtitan 0.3.0's own Llama3 model (not transformers'), built from its config classes at a small size
(issue 23's field bed): no weights, no network, no trainer. Needs the optional extra:
pip install -e '.[titan]' (torchtitan, spmd_types, tyro, docstring_parser).

2 layers, dim 64, 4 heads of 16 over 2 key/value heads, FFN width 128, vocab 128, float32. Attention
projects q, k and v with one fused layer, `attention.qkv_linear.wqkv` [128, 64], laid out by key/value
group ([q_0, q_1, k_0, v_0, q_2, q_3, k_1, v_1] in heads): a colwise split hands each rank whole groups.
Its state dict is not its parameters: state-dict hooks rename `wqkv` to the stock `wq`/`wk`/`wv` on save
and merge them back on load, as torchtitan's checkpoints and HF adapter expect. The rotary table is a
complex64 buffer of each layer's `attention.rope`.

Four things differ from torchtitan's trainer, for the CPU and for torch 2.11:
- torchtitan imports its expert-parallel kernels (`torchtitan.distributed.minimal_async_ep.kernels`) on
  every model's import path, and they `import triton`, which a CPU machine lacks. Llama3 has no experts
  and never calls them, so that one module is replaced by a stub before the import (only when triton is
  missing). Stubbing `triton` itself would not do: torch probes triton's submodules when it sees one.
- torchtitan 0.3.0 imports `torch.distributed.fsdp.DataParallelMeshDims`, which torch has from 2.12 on;
  under an older torch (the GPU machines' 2.11) a stand-in record takes its place. Only torchtitan's own
  FSDP code uses it, and this model file never calls that.
- torchtitan's expert-parallel token dispatcher (the MoE models', examples/field/titan_qwen3_moe.py) asks
  `torch.compiler._is_non_strict_tracing()`, which torch has from 2.12 on; under 2.11 a stand-in answers
  False, as 2.12's does outside a non-strict export trace (nothing here is exported).
- torchtitan builds language models with FlexAttention or varlen attention, neither of which has a CPU
  backward; this model uses torchtitan's own SDPA attention module (causal), as its Flux model does.

`build_model` returns the model initialised as torchtitan's trainer initialises it (`init_states`), so
`init cpu` and `init auto` reproduce its values bitwise.
"""

import dataclasses
import importlib.util
import sys
import types

import torch

from examples.field.common import SEQ, VOCAB, causal_lm_loss, example_input  # noqa: F401

if importlib.util.find_spec("triton") is None:  # see the docstring: a CPU machine

    class _Stub(types.ModuleType):
        """Any attribute, any call: stands in for the triton kernels a CPU run never calls."""

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return self

        def __call__(self, *args, **kwargs):
            return self

    _KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
    sys.modules.setdefault(_KERNELS, _Stub(_KERNELS))

import torch.distributed.fsdp as _fsdp  # noqa: E402

if not hasattr(_fsdp, "DataParallelMeshDims"):  # torch < 2.12 (the GPU machines run 2.11): see the docstring

    @dataclasses.dataclass(frozen=True)
    class DataParallelMeshDims:
        """Stands in for torch 2.12's record of which mesh dims FSDP shards and replicates over, which
        torchtitan's own FSDP code imports (and this model file never calls)."""

        shard: object = None
        replicate: object = None

    _fsdp.DataParallelMeshDims = DataParallelMeshDims

if not hasattr(torch.compiler, "_is_non_strict_tracing"):  # torch < 2.12: see the docstring
    torch.compiler._is_non_strict_tracing = lambda: False

import torchtitan.models.llama3 as llama3  # noqa: E402
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402

DIM, HEADS, KV_HEADS, FFN = 64, 4, 2, 128


def config() -> llama3.Llama3Model.Config:
    layers = llama3._build_llama3_layers(
        fuse_qkv=True,
        n_layers=2,
        dim=DIM,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        hidden_dim=FFN,
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000, scaling="none"),
        attn_backend="flex",  # replaced just below: only its name is read here
    )
    return sdpa(
        llama3.Llama3Model.Config(
            dim=DIM,
            vocab_size=VOCAB,
            tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
            lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)),
            layers=layers,
        )
    )


def sdpa(config: llama3.Llama3Model.Config) -> llama3.Llama3Model.Config:
    """`config` with torchtitan's own SDPA attention module (causal) in every layer, in place of the
    FlexAttention or varlen one its config functions choose (see the docstring); returned for chaining."""
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def build_model() -> llama3.Llama3Model:
    model = config().build()
    model.init_states()
    return model


def loss(output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(output, inputs)  # torchtitan's model returns the logits themselves
