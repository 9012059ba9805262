"""Jobs the Hugging Face weights tests run on every rank of a worker pool: build a transformers model as
`apply --hf DIR` does, apply a plan, load DIR while counting what safetensors reads, and report every
full tensor; then `apply --load DIR` itself, whose report the test reads."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import shardlang
from shardlang.checkpoints.hf import load_hf_weights, save_hf_weights
from shardlang.frontend.ir import Check
from shardlang.launch.job import Job, run
from shardlang.runtime.apply import apply_plan
from shardlang.runtime.modelfile import load_model_file


class _Counting:
    """A safetensors file handle that records the shape and bytes of every block read from it."""

    def __init__(self, handle, reads: dict):
        self._handle, self._reads = handle, reads

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def get_slice(self, name):
        handle, reads = self._handle, self._reads

        class Slice:
            def __getitem__(self, index):
                block = handle.get_slice(name)[index]
                reads.setdefault(name, []).append((tuple(block.shape), block.numel() * block.element_size()))
                return block

        return Slice()

    def get_tensor(self, name):
        block = self._handle.get_tensor(name)
        self._reads.setdefault(name, []).append((tuple(block.shape), block.numel() * block.element_size()))
        return block


def load_counting(plan_path: str, directory: str, save: str, shard_bytes: int) -> dict:
    """The plan applied to the model `--hf directory` builds, then `directory` loaded into it: per tensor
    what this rank read, its local shard's shape, and every full tensor (on every rank); then the model
    saved as Hugging Face weights in `save`, in files of `shard_bytes`."""
    import safetensors

    model_file = load_model_file(hf=directory, seq=16)
    plan = shardlang.load(plan_path, {}, world_size=dist.get_world_size())
    torch.manual_seed(0)
    model = plan.build(model_file.build_model)
    apply_plan(plan, model)
    reads: dict = {}
    real = safetensors.safe_open
    safetensors.safe_open = lambda *args, **kwargs: _Counting(real(*args, **kwargs), reads)
    try:
        transfer = load_hf_weights(model, directory)
    finally:
        safetensors.safe_open = real
    save_hf_weights(model, save, shard_bytes=shard_bytes)
    state = model.state_dict(keep_vars=True)
    return {
        "reads": reads,
        "local": {k: tuple(v.to_local().shape if isinstance(v, DTensor) else v.shape) for k, v in state.items()},
        "sharded": sorted(k for k, v in state.items() if isinstance(v, DTensor) and v.to_local().shape != v.shape),
        "full": {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone() for k, v in state.items()
        },
        "tied": state["lm_head.weight"] is state["model.embed_tokens.weight"],
        "tensors": transfer.tensors,
    }


def load_cases_then_apply(cases: list[tuple], plan_path: str, directory: str) -> dict:
    """`load_counting` for each case, then what `apply plan_path --hf directory --load directory --verify
    init,gradients --steps 1` reports."""
    loaded = [load_counting(*case) for case in cases]
    job = Job(
        plan_path,
        {},
        None,
        None,
        (Check("init", (), None), Check("gradients", (("steps", 1),), None)),
        model_file=load_model_file(hf=directory, seq=16),
        load=directory,
    )
    return {"loaded": loaded, "report": run(job)}
