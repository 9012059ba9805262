"""The dry run's model of benchmarks/titan_compare.py as a model file: torchtitan's Llama3 at
examples/field/titan_llama3.py's size with the 1B's tied embedding (benchmarks/titan_1b.py,
`configure(tiny=True)`), to check the benchmark plans on CPU workers:

    shardlang apply benchmarks/plans/titan_1b_fsdp.sl benchmarks/titan_1b_tiny.py --nproc 2
"""

import torch

from benchmarks import titan_1b


def build_model() -> torch.nn.Module:
    model = titan_1b.configure(tiny=True).build()
    model.init_states()  # as torchtitan's trainer initialises it, so `init meta with init_states` matches
    return model


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return titan_1b.example_input(batch_size, generator, tiny=True)


loss = titan_1b.loss
