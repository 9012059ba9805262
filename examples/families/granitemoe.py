"""transformers' GraniteMoeForCausalLM (GraniteMoE), from a small GraniteMoeConfig: a mixture of experts whose
experts are one parallel-experts module with a top-k gating module (issue 39). 2 layers, hidden 64, 4 experts."""

from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

from examples.families.common import EXPERTS, NO_IDS, SMALL, example_input, loss  # noqa: F401


def build_model() -> GraniteMoeForCausalLM:
    config = GraniteMoeConfig(**NO_IDS, **{**SMALL, **EXPERTS}, num_local_experts=4, num_experts_per_tok=2)
    return GraniteMoeForCausalLM(config)
