"""Hugging Face transformers' own Qwen3ForCausalLM, built from a small Qwen3Config: no weights, no
network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 attention heads over 2 key/value heads, per-head q/k RMSNorms, vocab 128,
float32. Its rotary table (`model.rotary_emb.inv_freq`) is a non-persistent buffer computed in
__init__: the case `init meta` must keep real.
"""

from transformers import Qwen3Config, Qwen3ForCausalLM

# The same inputs and loss as the Llama example: random token ids, next-token cross-entropy.
from examples.hf_llama import SEQ, SMALL, VOCAB, example_input, loss  # noqa: F401


def build_model() -> Qwen3ForCausalLM:
    config = Qwen3Config(**SMALL, head_dim=16)
    return Qwen3ForCausalLM(config)
