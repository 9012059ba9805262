"""transformers' ModernBertForMaskedLM (ModernBERT), from a small ModernBertConfig: an encoder whose
attention keeps q, k and v packed in one `Wqkv`, whose layers alternate global and sliding-window attention,
and whose decoder is tied to the token embedding (issue 39). 2 layers, hidden 64, vocab 128. The loss is
the masked-LM loss with every position a label (random ids stand in for masked text)."""

import torch
import torch.nn.functional as F
from transformers import ModernBertConfig, ModernBertForMaskedLM

from examples.families.common import NO_IDS, SEQ, VOCAB, example_input  # noqa: F401


def build_model() -> ModernBertForMaskedLM:
    config = ModernBertConfig(
        **NO_IDS,
        cls_token_id=None,
        sep_token_id=None,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        global_attn_every_n_layers=2,
        local_attention=8,
        attn_implementation="sdpa",
    )
    return ModernBertForMaskedLM(config)


def loss(output, inputs: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), inputs.flatten())
