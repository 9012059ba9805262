"""What the installed torch cannot run, by release, in one place (the compiler's counterpart of
runtime/torchcompat.py, which it may not import: the compiler never imports torch.distributed).

Each limit was found by running the case on gloo; `tests/test_hostile.py::test_torch_limits_match_the
_installed_torch` runs the same cases on the installed torch and checks this table says what it does.
"""

from __future__ import annotations

import re

import torch

#: A rowwise nn.Linear whose in_features do not divide by the TP size, with its input as `shard(-1)` (the
#: default) given as a local tensor: RowwiseParallel rebuilds the input with `DTensor.from_local`, which
#: assumes equal chunks, so the matmul sees e.g. 33 columns against 32 ("a and b must have same
#: reduction dim"). Colwise Linear and both Embedding styles run uneven shards correctly.
ROWWISE_UNEVEN_LOCAL_INPUT = "rowwise_uneven_local_input"

#: (major, minor) -> the limits of that release. A release newer than the newest here is assumed to
#: have that one's limits (no later fix is known); an older one the oldest's.
LIMITS: dict[tuple[int, int], frozenset[str]] = {
    (2, 11): frozenset({ROWWISE_UNEVEN_LOCAL_INPUT}),
    (2, 13): frozenset({ROWWISE_UNEVEN_LOCAL_INPUT}),  # tested here: tests/test_hostile.py
}


def release(version: str | None = None) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    return (int(found.group(1)), int(found.group(2))) if found else max(LIMITS)


def limits(version: str | None = None) -> frozenset[str]:
    """What `version` (default: the installed torch) cannot run."""
    key = release(version)
    known = sorted(LIMITS)
    nearest = max((k for k in known if k <= key), default=known[0])
    return LIMITS[nearest]


def cannot(limit: str, version: str | None = None) -> bool:
    return limit in limits(version)
