"""torchtitan 0.3.0's own Qwen3-MoE at about 1.2B parameters, the model of `benchmarks/titan_compare.py
--config ep` and its plan (benchmarks/plans/titan_moe_ep.sl); also a model file for `shardlang
lint|explain` (`build_model()` builds it: on the meta device, as they call it, it is quick).

Built from torchtitan's own Qwen3-MoE config function (`_build_qwen3_moe_layers`, through
examples/field/titan_qwen3_moe.py's `config`, with torchtitan's SDPA attention, whose import also brings the
CPU and torch 2.11 shims), at the size of benchmarks/ep_compare.py's Mixtral: 16 layers, dim 1024, 16
heads of 64 over 8 key/value heads (q and k norms), in every layer 8 experts of width 2816, top 2
(softmax scores normalised over the two chosen), vocabulary 32000, no weight tying: 1.21B parameters, of
which 1.11B are experts; float32 parameters, sequence 2048. As torchtitan's trainer does through
`update_from_config`, `configure` fills the sharding config torchtitan's own parallelize reads
(`set_qwen3_sharding_config`, expert parallelism on; shardlang's side never reads it) and cuts the RoPE
tables to the training sequence. Each MoE block keeps torchtitan's load-balancing buffers; no optimizer
hook updates `expert_bias_E` on either side (the trainer's `register_moe_load_balancing_hook` is not
installed), so the routing is the router's own on both.

`configure(tiny=True)` is the dry-run size: examples/field/titan_qwen3_moe.py's (2 layers, dim 64, 8 experts
of width 32, top 2, vocabulary 128, sequence 16).
"""

from __future__ import annotations

import dataclasses

import torch

from examples.field import titan_qwen3_moe as field  # first: torchtitan's stand-ins

# isort: split
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

from benchmarks.titan_1b import titan_flops_per_token

SEQ, VOCAB = 2048, 32000
SIZE = dict(layers=16, dim=1024, heads=16, kv_heads=8, head_dim=64, experts=8, expert_width=2816, top_k=2)


def configure(tiny: bool = False):
    """The model's config, ready to build: the 1.2B, or the dry run's tiny one (see the docstring)."""
    config = field.config() if tiny else field.config(**SIZE, vocab=VOCAB, seq=SEQ)
    set_qwen3_sharding_config(config, enable_sp=True, enable_ep=True)
    for layer in config.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq(tiny))
    return config


def seq(tiny: bool = False) -> int:
    return field.SEQ if tiny else SEQ


def vocab(tiny: bool = False) -> int:
    return field.VOCAB if tiny else VOCAB


def build_model():
    """The 1.2B where the caller's device says (meta for lint and `init meta`), initialised as torchtitan's
    trainer initialises it (`init_states`), so that `init meta with init_states` reproduces it."""
    model = configure().build()
    model.init_states()
    return model


def example_input(batch_size: int, generator: torch.Generator, tiny: bool = False) -> torch.Tensor:
    return torch.randint(0, vocab(tiny), (batch_size, seq(tiny)), generator=generator)


loss = field.loss


def flops_per_token(tiny: bool = False) -> float:
    """Training FLOPs per token as torchtitan's trainer counts them for MFU (its `get_nparams_and_flops`
    for MoE models: the active parameters, the top-k experts, plus attention)."""
    return titan_flops_per_token(configure(tiny), seq(tiny))
