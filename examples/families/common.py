"""What the families of issue 39 share (transformers families first tried by a new user, not by us): the
field bed's small decoder sizes, random token ids and the causal language-model loss. Not a model file
itself. Each model file here builds its family tiny from its config class: no weights, no network. Needs
the optional extra: pip install -e '.[hf]'."""

from examples.field.common import NO_IDS, SEQ, SMALL, VOCAB, example_input, loss  # noqa: F401

#: A mixture of experts' few, narrow experts: 4 experts of width 32, top 2.
EXPERTS = dict(intermediate_size=32)
