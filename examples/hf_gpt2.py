"""Hugging Face transformers' own GPT2LMHeadModel, built from a small GPT2Config: no weights, no network.
Needs the optional extra: pip install -e '.[hf]'.

2 layers, width 64, 4 heads, vocab 128, float32, dropout off. Its projections are transformers'
Conv1D, which stores its weight [in, out] (the transpose of nn.Linear's): `attn.c_attn` packs
[q; k; v] along its 192 output columns, `mlp.c_fc` and `mlp.c_proj` are the feed-forward pair.
transformers gives GPT-2 no tensor-parallel plan: plans/hf/gpt2.sl is written by hand.
"""

from transformers import GPT2Config, GPT2LMHeadModel

# The same inputs and loss as the Llama example: random token ids, next-token cross-entropy.
from examples.hf_llama import SEQ, VOCAB, example_input, loss  # noqa: F401


def build_model() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config)
