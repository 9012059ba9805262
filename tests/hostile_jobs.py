"""Jobs for tests/test_hostile.py that run on a worker pool (importable by the spawned workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


def uneven_tp_cases() -> dict[str, bool]:
    """Which uneven tensor-parallel cases the installed torch runs (forward, backward and the gradients),
    on a 1-D mesh of the whole world: what compiler/torchlimits.py must say of this torch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    uneven = 4 * n + 1  # divides by no world size > 1
    cases = {
        # name: (modules, plan, input)
        "colwise_uneven_out": (
            nn.Sequential(nn.Linear(8, uneven)),
            {"0": ColwiseParallel(output_layouts=Replicate())},
            torch.randn(4, 8),
        ),
        "rowwise_uneven_local_input": (
            nn.Sequential(nn.Linear(8, uneven), nn.ReLU(), nn.Linear(uneven, 8)),
            {"0": ColwiseParallel(), "2": RowwiseParallel()},
            torch.randn(4, 8),
        ),
        "rowwise_uneven_replicated_input": (
            nn.Sequential(nn.Linear(uneven, 8)),
            {"0": RowwiseParallel(input_layouts=Replicate())},
            torch.randn(4, uneven),
        ),
        "rowwise_uneven_dtensor_input": (
            nn.Sequential(nn.Linear(8, uneven), nn.ReLU(), nn.Linear(uneven, 8)),
            {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel()},
            torch.randn(4, 8),
        ),
        "embedding_rowwise_uneven": (
            nn.Sequential(nn.Embedding(uneven, 8)),
            {"0": RowwiseParallel()},
            torch.randint(0, uneven, (4, 3)),
        ),
    }
    runs = {}
    for name, (model, plan, x) in cases.items():
        torch.manual_seed(0)
        try:
            parallelize_module(model, mesh, plan)
            y = model(x)
            (y.full_tensor() if hasattr(y, "full_tensor") else y).sum().backward()
            for p in model.parameters():
                p.grad.full_tensor()
            runs[name] = True
        except Exception:  # noqa: BLE001 - a case torch cannot run
            runs[name] = False
    return runs
