"""What the field models (examples/field/, issue 23) share: random token ids in, and the causal
language-model loss on them, shifted by one without copying the logits. Not a model file itself.

The labels are the tokens rolled left by one with the last position ignored, so cross-entropy reads the
logits in place (`flatten(0, 1)` of a contiguous tensor is a view): slicing `logits[:, :-1]` would copy
the whole [batch, seq, vocab] tensor, which at a real vocabulary is the largest activation of the step.
"""

import torch

from examples.llama import causal_lm_loss

# The small decoder the Hugging Face examples share: 2 layers, hidden 64, vocab 128, float32.
from examples.small import SEQ, SMALL, VOCAB  # noqa: F401


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator)


def loss(output, inputs: torch.Tensor) -> torch.Tensor:
    """The loss of a transformers causal LM (its output has `.logits`)."""
    return causal_lm_loss(output.logits, inputs)


#: No special token ids: several families' defaults (eos 50279, 255001, ...) lie outside vocab 128, which
#: transformers warns about; these models only ever see random ids.
NO_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
