"""The dry run's model of `benchmarks/titan_compare.py --config ep` as a model file: torchtitan's Qwen3-MoE
at examples/field/titan_qwen3_moe.py's size with the benchmark's configuration (benchmarks/titan_moe.py,
`configure(tiny=True)`), to check the benchmark's plan on CPU workers:

    shardlang apply benchmarks/plans/titan_moe_ep.sl benchmarks/titan_moe_tiny.py --nproc 2
"""

import torch

from benchmarks import titan_moe


def build_model() -> torch.nn.Module:
    model = titan_moe.configure(tiny=True).build()
    model.init_states()  # as torchtitan's trainer initialises it, so `init meta with init_states` matches
    return model


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return titan_moe.example_input(batch_size, generator, tiny=True)


loss = titan_moe.loss
