"""The walks over a module's output or inputs (a tensor, tuples, lists, dicts, transformers' ModelOutput)
that torch's pytree does (issue 40): each finds or casts what the hand-written recursion it replaced did."""

import torch
from transformers.modeling_outputs import BaseModelOutput

from shardlang.compiler.rules.positions import _sequence_tensor
from shardlang.verification.recording import _first_tensor
from shardlang.verification.reference import _cast

X, Y = torch.ones(2, 5), torch.zeros(2, 3)
IDS = torch.ones(2, 5, dtype=torch.long)


def test_the_first_floating_point_tensor_of_an_output():
    assert _first_tensor(X) is X
    assert _first_tensor(IDS) is None
    assert _first_tensor((IDS, [None, Y], X)) is Y
    assert _first_tensor({"ids": IDS, "none": None, "h": X}) is X
    assert _first_tensor(BaseModelOutput(last_hidden_state=Y, hidden_states=(X,))) is Y
    assert _first_tensor(BaseModelOutput(hidden_states=(IDS, X))) is X
    assert _first_tensor(("text", 3, None)) is None


def test_the_first_floating_point_tensor_along_the_sequence():
    assert _sequence_tensor((Y, {"ids": IDS, "h": X}), 5) is X
    assert _sequence_tensor(BaseModelOutput(last_hidden_state=X), 5) is X
    assert _sequence_tensor((Y, IDS), 5) is None


def test_inputs_cast_to_the_references_dtype_keep_their_containers():
    cast = _cast((X, [IDS, {"k": Y}], None, 3), torch.float64)
    assert type(cast) is tuple and type(cast[1]) is list and type(cast[1][1]) is dict
    assert cast[0].dtype == cast[1][1]["k"].dtype == torch.float64
    assert cast[1][0] is IDS and cast[2:] == (None, 3)
    assert torch.equal(cast[0], X.double())
