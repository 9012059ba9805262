"""transformers' FalconForCausalLM in its new decoder architecture (Falcon-40B/180B), from a small
FalconConfig (issue 23's field bed): no weights, no network. Needs the optional extra:
pip install -e '.[hf]'.

2 layers, hidden 64, 4 query heads of 16 over 2 key/value heads in one fused projection
`self_attention.query_key_value` [128, 64] laid out by key/value group, [q_0, q_1, k_0, v_0, q_2, q_3,
k_1, v_1] (the model views its output as [groups, 2 + 2, 16]), two LayerNorms feeding attention and MLP
side by side, no biases, untied output, vocab 128, float32.
"""

from transformers import FalconConfig, FalconForCausalLM

from examples.field.common import NO_IDS, SEQ, VOCAB, example_input, loss  # noqa: F401


def build_model() -> FalconForCausalLM:
    config = FalconConfig(
        **NO_IDS,
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        new_decoder_architecture=True,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return FalconForCausalLM(config)
