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

#: A zero-bubble schedule (zero_bubble, zbv, dualpipe_v: the backward split into an input pass and a
#: weight pass) with data-parallel units over more than one rank: FSDP2 reduces the gradients before the
#: weight pass has added to them, and every stage's gradients are wrong (the gradients check, pp 2 x dp 2,
#: on gloo with torch 2.13 and on NCCL with 2.11). Without data parallelism the same schedules are right.
ZERO_BUBBLE_DATA_PARALLEL = "zero_bubble_data_parallel"

#: A V-shaped schedule (zbv, dualpipe_v: one rank holds the first stage and the last) over gloo: torch
#: 2.11's schedule sends to the rank itself while its stages learn their shapes, which gloo refuses ("Pair
#: is not connected"), with or without data parallelism (pp 2 and pp 2 x dp 2, on the CPU). 2.13 runs it.
V_SCHEDULE_GLOO = "v_schedule_gloo"

#: `compile (fullgraph=true)` of a module that activation checkpointing covers (the module itself or one
#: inside it): the composable checkpoint's hooks hold a context manager dynamo cannot rebuild, and the
#: first forward raises "reconstructing @contextmanager object" (torch 2.13 on the CPU, any backend;
#: tests/test_compile.py runs the case on the installed torch). Without fullgraph the hooks break the graph
#: and the step runs. Not run on 2.11 yet: its entry says nothing of it.
COMPILE_FULLGRAPH_CHECKPOINT = "compile_fullgraph_checkpoint"

#: (major, minor) -> the limits of that release. A release newer than the newest here is assumed to
#: have that one's limits (no later fix is known); an older one the oldest's.
LIMITS: dict[tuple[int, int], frozenset[str]] = {
    # ZB: 4 x H200, RESULTS.md; V over gloo: torch 2.11 on the CPU machine (tests/test_pipeline.py)
    (2, 11): frozenset({ROWWISE_UNEVEN_LOCAL_INPUT, ZERO_BUBBLE_DATA_PARALLEL, V_SCHEDULE_GLOO}),
    (2, 13): frozenset(
        {ROWWISE_UNEVEN_LOCAL_INPUT, ZERO_BUBBLE_DATA_PARALLEL, COMPILE_FULLGRAPH_CHECKPOINT}
    ),  # tested: test_hostile, test_pipeline
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
