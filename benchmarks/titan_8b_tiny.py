"""The dry run's model of `benchmarks/titan_compare.py --size 8b` as a model file: torchtitan's Llama3 at
examples/field/titan_llama3.py's size, untied as the 8B is (benchmarks/titan_8b.py, `configure(tiny=True)`),
to check the 8B's benchmark plans on CPU workers:

    shardlang apply benchmarks/plans/titan_8b_fsdp.sl benchmarks/titan_8b_tiny.py --nproc 2
"""

import torch

from benchmarks import titan_8b


def build_model() -> torch.nn.Module:
    model = titan_8b.configure(tiny=True).build()
    model.init_states()  # as torchtitan's trainer initialises it, so `init meta with init_states` matches
    return model


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return titan_8b.example_input(batch_size, generator, tiny=True)


loss = titan_8b.loss
