"""transformers' MptForCausalLM (MosaicML MPT), from a small MptConfig (issue 23's field bed): no
weights, no network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 heads of 16, ALiBi (no position embeddings), one fused projection `attn.Wqkv`
[192, 64] packing [q; k; v] block after block (the model splits its output in three), no biases, MLP of
width 128, output tied to the embedding, vocab 128, float32. transformers runs MPT's attention eagerly.
"""

from transformers import MptConfig, MptForCausalLM

from examples.field.common import NO_IDS, SEQ, VOCAB, example_input, loss  # noqa: F401


def build_model() -> MptForCausalLM:
    config = MptConfig(
        **NO_IDS,
        vocab_size=VOCAB,
        d_model=64,
        n_layers=2,
        n_heads=4,
        expansion_ratio=2,
        max_seq_len=SEQ,
        attn_implementation="eager",
    )
    return MptForCausalLM(config)
