"""transformers' Glm4ForCausalLM (GLM-4), from a small Glm4Config: its MLP keeps gate and up packed in one
`gate_up_proj` that the model's own code splits with `chunk` (issue 39). 2 layers, hidden 64, vocab 128."""

from transformers import Glm4Config, Glm4ForCausalLM

from examples.families.common import NO_IDS, SMALL, example_input, loss  # noqa: F401


def build_model() -> Glm4ForCausalLM:
    return Glm4ForCausalLM(Glm4Config(**NO_IDS, **SMALL, head_dim=16))
