"""Hugging Face transformers' own Gemma3ForCausalLM (the text model), built from a small
Gemma3TextConfig: no weights, no network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 attention heads of 16 over 2 key/value heads, per-head q/k RMSNorms (transformers'
plan gives them `replicated_with_grad_allreduce`), sliding-window and global layers, vocab 128, float32.
The input embedding and the output layer share one weight, as in every Gemma checkpoint.
"""

from transformers import Gemma3ForCausalLM, Gemma3TextConfig

# The same inputs and loss as the Llama example: random token ids, next-token cross-entropy.
from examples.hf_llama import SEQ, SMALL, VOCAB, example_input, loss  # noqa: F401


def build_model() -> Gemma3ForCausalLM:
    # Tied, as in every Gemma checkpoint (the one difference from the shared small config).
    config = Gemma3TextConfig(**{**SMALL, "tie_word_embeddings": True}, head_dim=16, sliding_window=8)
    return Gemma3ForCausalLM(config)
