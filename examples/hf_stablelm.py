"""Hugging Face transformers' own StableLmForCausalLM with per-head q/k layer norms (`qk_layernorm`: each
attention holds a ModuleList of one LayerNorm per head, more numerous than the layers), built from a small
StableLmConfig; transformers gives it no TP plan. Needs the optional extra: pip install -e '.[hf]'.
"""

from transformers import StableLmConfig, StableLmForCausalLM

from examples.hf_llama import SEQ, SMALL, VOCAB, example_input, loss  # noqa: F401


def build_model():
    return StableLmForCausalLM(StableLmConfig(**SMALL, qk_layernorm=True))
