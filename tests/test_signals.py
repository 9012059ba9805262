"""time_limit bounds user code, but never cuts short torch importing itself (which would leave torch
half-imported for the rest of the process)."""

import time

import pytest

from shardlang.cli.signals import time_limit
from shardlang.cli.status import UsageError


def _find_and_load(name: str, seconds: float) -> str:
    """Stands for importlib's frame of the same name, importing `name` for `seconds`."""
    time.sleep(seconds)
    return name


def test_an_alarm_waits_for_torch_to_finish_importing():
    with time_limit(0.05, "the traced forward"):
        assert _find_and_load("torch.distributed.tensor", 0.3) == "torch.distributed.tensor"


def test_an_alarm_stops_user_code_and_other_imports():
    with pytest.raises(UsageError, match="the traced forward took longer than --timeout 0.05 s"):
        with time_limit(0.05, "the traced forward"):
            _find_and_load("my_model", 5.0)
    with pytest.raises(UsageError):
        with time_limit(0.05, "the traced forward"):
            time.sleep(5.0)
