"""Jobs the checkpoint tests run on every rank of a worker pool: train under one plan and save, load
under another, and report every full tensor (model and optimizer state) so the test can compare them
bit for bit. Also a save that a rank dies in the middle of."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

import shardlang
from shardlang.checkpoints.loading import load_checkpoint
from shardlang.checkpoints.saving import save_checkpoint
from shardlang.runtime.apply import apply_plan

from .dist_jobs import load


def build(plan_path: str, params: dict, model: str) -> torch.nn.Module:
    plan = shardlang.load(plan_path, params, world_size=dist.get_world_size())
    torch.manual_seed(0)
    module = plan.build(load(model))
    apply_plan(plan, module)
    return module


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Every full tensor of the model's and optimizer's state dicts, on the CPU, by name."""
    options = StateDictOptions(full_state_dict=True)
    state = {f"model.{k}": _full(v) for k, v in get_model_state_dict(model, options=options).items()}
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer, options=options)
        for fqn, entries in osd["state"].items():
            state.update({f"optimizer.{fqn}.{k}": _full(v) for k, v in entries.items()})
        state["optimizer.param_groups"] = [dict(g) for g in osd["param_groups"]]
    return state


def _full(value):
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def train_and_save(plan_path: str, params: dict, model: str, directory: str, steps: int = 2) -> dict:
    """`steps` Adam steps under the plan (the same tokens on every rank), then save; what was saved."""
    from examples.llama import example_input, loss

    module = build(plan_path, params, model)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    for step in range(steps):
        tokens = example_input(4, torch.Generator().manual_seed(step)).to(device)
        loss(module(tokens), tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    save_checkpoint(module, directory, optimizer)
    return full_state(module, optimizer)


def load_under(plan_path: str, params: dict, model: str, directory: str, optimizer: bool = True) -> dict:
    """A freshly built model (and an Adam of another lr) under the plan, loaded from `directory`."""
    module = build(plan_path, params, model)
    optim = torch.optim.Adam(module.parameters(), lr=1e-4) if optimizer else None
    load_checkpoint(module, directory, optim)
    return full_state(module, optim)


def save_and_die(plan_path: str, model: str, directory: str, dying_rank: int) -> None:
    """Change every parameter, then save; `dying_rank` is killed while writing its part of the files."""
    import torch.distributed.checkpoint as dcp

    module = build(plan_path, {}, model)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    if dist.get_rank() == dying_rank:

        def write_and_die(self, plan, planner):
            time.sleep(0.5)  # let the other ranks write their files first
            os._exit(9)

        dcp.FileSystemWriter.write_data = write_and_die
    save_checkpoint(module, directory)
