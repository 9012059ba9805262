"""transformers' JambaForCausalLM (Jamba), from a small JambaConfig: a hybrid whose first layer is a Mamba
mixer (a causal convolution and a selective scan along the sequence, `A_log` with identical rows by
construction) and whose second is attention with a mixture of experts (issue 39). Hidden 64, vocab 128;
transformers' slow Mamba path (no CUDA kernels)."""

from transformers import JambaConfig, JambaForCausalLM

from examples.families.common import EXPERTS, NO_IDS, SMALL, example_input, loss  # noqa: F401


def build_model() -> JambaForCausalLM:
    config = JambaConfig(
        **NO_IDS,
        **{**SMALL, **EXPERTS},
        num_experts=4,
        num_experts_per_tok=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        use_mamba_kernels=False,
    )
    return JambaForCausalLM(config)
