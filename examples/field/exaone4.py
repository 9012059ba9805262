"""transformers' Exaone4ForCausalLM (EXAONE 4.0), from a small Exaone4Config (issue 23's field bed): no
weights, no network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 heads of 16 over 2 key/value heads, with per-head RMSNorms on q and k (q_norm
and k_norm, weight [16], shared by every head: a rank holding half the heads still applies them whole,
and their gradient is a sum over every rank's heads), the norms after attention and MLP
(post-layer-norm), vocab 128, float32.
"""

from transformers import Exaone4Config, Exaone4ForCausalLM

from examples.field.common import NO_IDS, SEQ, SMALL, VOCAB, example_input, loss  # noqa: F401


def build_model() -> Exaone4ForCausalLM:
    config = Exaone4Config(**NO_IDS, **SMALL, head_dim=16, layer_types=["full_attention"] * 2)
    return Exaone4ForCausalLM(config)
