"""The sizes the small example decoders share (not a model file): vocab 128, sequences of 16, and the
Hugging Face config fields of a 2-layer decoder, hidden 64, 4 attention heads over 2 key/value heads.
Kept apart from examples/hf_llama.py so that model files not built on transformers (torchtitan's) do not
import it."""

VOCAB, SEQ = 128, 16

#: The small decoder every Hugging Face example model here shares (each adds what its architecture needs).
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    tie_word_embeddings=False,
    attn_implementation="sdpa",
)
