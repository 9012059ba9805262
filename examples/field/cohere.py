"""transformers' CohereForCausalLM (Command-R) with its q/k norms on, from a small CohereConfig (issue
23's field bed): no weights, no network. Needs the optional extra: pip install -e '.[hf]'.

2 layers, hidden 64, 4 heads of 16 over 2 key/value heads. Attention and MLP run side by side on one
LayerNorm. `use_qk_norm` gives q and k a LayerNorm with a weight *per head* (q_norm [4, 16], k_norm
[2, 16]), so a rank holding half the heads cannot apply the whole norm. The output layer shares the
embedding's weight (tied, Cohere's default) and scales the logits by 1/16. Vocab 128, float32.
"""

from transformers import CohereConfig, CohereForCausalLM

from examples.field.common import NO_IDS, SEQ, SMALL, VOCAB, example_input, loss  # noqa: F401


def build_model() -> CohereForCausalLM:
    config = CohereConfig(**NO_IDS, **{**SMALL, "tie_word_embeddings": True}, use_qk_norm=True)
    return CohereForCausalLM(config)
