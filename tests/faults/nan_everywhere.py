"""tests/faults/nan_float64.py with a parameter whose gradient is not finite in every precision, which the
gradients check leaves out, saying so."""

from tests.faults.nan_float64 import build_model as _build
from tests.faults.nan_float64 import example_input  # noqa: F401


def build_model():
    return _build(nan_everywhere=True)
