"""transformers' PhimoeForCausalLM (PhiMoE), from a small PhimoeConfig: a mixture of experts with its own
sparsemixer router and its default experts implementation (issue 39). 2 layers, hidden 64, 4 experts (top 2)."""

from transformers import PhimoeConfig, PhimoeForCausalLM

from examples.families.common import EXPERTS, NO_IDS, SMALL, example_input, loss  # noqa: F401


def build_model() -> PhimoeForCausalLM:
    config = PhimoeConfig(**NO_IDS, **{**SMALL, **EXPERTS}, num_local_experts=4, num_experts_per_tok=2)
    return PhimoeForCausalLM(config)
