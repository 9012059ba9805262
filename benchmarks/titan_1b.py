"""torchtitan 0.3.0's own Llama3 1B (`torchtitan.models.llama3.llama3_configs["1B"]`), the model of
benchmarks/titan_compare.py and its plans (benchmarks/plans/titan_1b_*.sl); also a model file for
`shardlang lint|explain` (`build_model()` builds the 1B: on the meta device, as they call it, it is quick).

Built from torchtitan's config as its trainer builds it (torchtitan/trainer.py), with three differences,
the same on both sides of the comparison:
- Attention is torchtitan's own SDPA module (causal), as in examples/field/titan_llama3.py, whose import
  also brings the CPU and torch 2.11 shims (triton's stand-in, DataParallelMeshDims). The 1B's config asks
  for FlexAttention, whose block masks the trainer builds from each batch's document positions; SDPA
  needs no mask (on H100/H200 it runs cuDNN or flash attention).
- The trainer's `model_config.update_from_config(config=trainer_config)` imports `torchtitan.trainer`,
  which needs torchdata; what it does for a dense Llama3 is done here instead: torchtitan's own
  `set_llama3_sharding_config(config, enable_sp=True)` (the TP layout its `parallelize` reads; sequence
  parallelism is its default) and the RoPE tables cut to the training sequence (`max_seq_len = SEQ`).
- `configure(tiny=True)` is the dry-run size: examples/field/titan_llama3.py's config (2 layers, dim 64,
  4 heads over 2 key/value heads, vocabulary 128, sequence 16) with the 1B's weight tying (the embedding
  and `lm_head` share one weight, initialised by `lm_head`'s init), so that torchtitan and the plans take
  the same branches as for the 1B.

The 1B: 16 layers, dim 2048, 32 heads over 8 key/value heads, FFN 8192, vocabulary 128256, tied embedding
(1.24B parameters), float32 parameters, sequence 2048.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_module, distribute_tensor

from examples.field import titan_llama3 as field  # first: the triton stub and DataParallelMeshDims shim
from examples.llama import causal_lm_loss

# isort: split
import torchtitan.models.llama3 as llama3
from torchtitan.models.llama3.sharding import set_llama3_sharding_config

SEQ = 2048


def configure(tiny: bool = False, size: str = "1B") -> llama3.Llama3Model.Config:
    """The model's config, ready to build: the 1B, or the dry run's tiny one (see the docstring); `size`
    another of torchtitan's Llama3 configs (benchmarks/titan_8b.py: "8B", untied, and so its tiny one)."""
    if tiny:
        config = field.config()
        if size == "1B":
            config.enable_weight_tying = True
            config.tok_embeddings.param_init = llama3._EMBEDDING_SKIP_INIT
    else:
        config = field.sdpa(llama3.llama3_configs[size](attn_backend="flex"))
    set_llama3_sharding_config(config, enable_sp=True)
    for layer in config.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq(tiny))
    return config


def seq(tiny: bool = False) -> int:
    return field.SEQ if tiny else SEQ


def vocab(tiny: bool = False) -> int:
    return field.VOCAB if tiny else 128256


def build_model() -> llama3.Llama3Model:
    """The 1B where the caller's device says (meta for lint and `init meta`), initialised as torchtitan's
    trainer initialises it (`init_states`), so that `init meta with init_states` reproduces it."""
    model = configure().build()
    model.init_states()
    return model


def example_input(batch_size: int, generator: torch.Generator, tiny: bool = False) -> torch.Tensor:
    return torch.randint(0, vocab(tiny), (batch_size, seq(tiny)), generator=generator)


def loss(output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on torchtitan's logits (bf16 under mixed precision; upcast inside)."""
    return causal_lm_loss(output, inputs)


def vocab_parallel(module: nn.Module, mesh: DeviceMesh) -> None:
    """A `use` style (benchmarks/plans/titan_1b_tp_*.sl): torchtitan's own vocabulary-parallel embedding, as
    its TP layout makes it (`Embedding.parallelize` and `set_decoder_sharding_config`): the weight split over
    the vocabulary (Shard(0)) on `mesh`, the module's own forward doing the masked lookup on its slice once
    its `tp_group` is set, and the partial sums reduce-scattered onto the sequence (Shard(1)), handed on as a
    local tensor. torch's RowwiseParallel cannot take this module (its forward calls `to_local()` itself);
    keeping the weight whole instead would place the weight it shares with the colwise `lm_head` apart."""

    def partition(name, child, device_mesh):
        weight = distribute_tensor(child.weight, device_mesh, [Shard(0)])
        child.register_parameter("weight", nn.Parameter(weight, requires_grad=child.weight.requires_grad))

    def reduce_scatter(child, output, device_mesh):
        partial = DTensor.from_local(output, device_mesh, [Partial()], run_check=False)
        return partial.redistribute(device_mesh, [Shard(1)]).to_local()

    module.tp_group = mesh.get_group()
    distribute_module(module, mesh, partition, output_fn=reduce_scatter)


def flops_per_token(tiny: bool = False) -> float:
    """Training FLOPs per token as torchtitan's trainer counts them for MFU (its
    `get_nparams_and_flops`: 6 per parameter-token, the tied embedding counted once, plus attention)."""
    return titan_flops_per_token(configure(tiny), seq(tiny))


def titan_flops_per_token(config, seq_len: int) -> float:
    """What torchtitan's trainer counts for MFU of a model of `config` at `seq_len` tokens a sequence: its
    config's own `get_nparams_and_flops`, on the model built on the meta device."""
    with torch.device("meta"):
        model = config.build()
    return float(config.get_nparams_and_flops(model, seq_len)[1])
