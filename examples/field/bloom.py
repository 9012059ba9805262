"""transformers' BloomForCausalLM, from a small BloomConfig (issue 23's field bed): no weights, no
network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 heads of 16, ALiBi (a per-head linear bias on the attention scores instead of
position embeddings; the model builds it for all 4 heads), one fused projection
`self_attention.query_key_value` [192, 64] laid out head by head and viewed with the model's own head
count, a LayerNorm right after the embedding, GELU MLP of width 256, the output tied to the embedding,
vocab 128, float32. transformers runs Bloom's attention eagerly (it has no SDPA path).
"""

from transformers import BloomConfig, BloomForCausalLM

from examples.field.common import NO_IDS, SEQ, VOCAB, example_input, loss  # noqa: F401


def build_model() -> BloomForCausalLM:
    config = BloomConfig(**NO_IDS, vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, attn_implementation="eager")
    return BloomForCausalLM(config)
