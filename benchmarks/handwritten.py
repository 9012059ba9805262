"""The torchtitan-style tensor-parallel calls for examples/llama.py, as a user writes them by hand: what
plans/llama_2d.sl's `parallelize` blocks lower to, shared by the benchmarks that time shardlang
against hand-written torch."""

from __future__ import annotations

import torch


def parallelize_llama(model: torch.nn.Module, tp_mesh) -> None:
    """Sequence-parallel norms, colwise/rowwise attention and feed-forward, rowwise embedding with a
    sequence-sharded output, and a colwise output layer gathering the logits."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
