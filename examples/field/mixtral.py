"""transformers' MixtralForCausalLM, a mixture of experts, from a small MixtralConfig (issue 23's field
bed): no weights, no network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 heads over 2 key/value heads, in every layer 4 experts (top 2) of width 128 held
as two 3-D tensors of `mlp.experts` (gate_up_proj [4, 256, 64], down_proj [4, 64, 128]), vocab 128,
float32. The experts keep transformers' default implementation (a grouped matmul, `torch._grouped_mm`),
as a user's model would.
"""

from transformers import MixtralConfig, MixtralForCausalLM

from examples.field.common import SEQ, SMALL, VOCAB, example_input, loss  # noqa: F401


def build_model() -> MixtralForCausalLM:
    return MixtralForCausalLM(MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2))
