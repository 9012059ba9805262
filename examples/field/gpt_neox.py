"""transformers' GPTNeoXForCausalLM (Pythia), from a small GPTNeoXConfig (issue 23's field bed): no
weights, no network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 heads of 16, one fused projection `attention.query_key_value` [192, 64] whose
rows are laid out head by head, [q_0; k_0; v_0; q_1; ...] (the model views its output as [heads, 3 x
16]), so a plain column split hands each rank whole heads; partial rotary (a quarter of each head),
attention and MLP side by side (parallel residual), biases everywhere, untied output, vocab 128, float32.
"""

from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from examples.field.common import NO_IDS, SEQ, VOCAB, example_input, loss  # noqa: F401


def build_model() -> GPTNeoXForCausalLM:
    config = GPTNeoXConfig(
        **NO_IDS,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return GPTNeoXForCausalLM(config)
