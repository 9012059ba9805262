"""Jobs for the seed scenarios (tests/test_seeds.py): what PyTorch's own tests assert beyond the five
checks, run on every rank of a worker pool after shardlang applied the scenario's plan."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardlang
from shardlang.runtime.apply import apply_plan
from shardlang.runtime.modelfile import load_model_file
from shardlang.verification import Context, combine, gather, run_checks
from shardlang.verification.comms import count_collectives


def _applied(plan_path: str, model_path: str, seed: int = 0):
    plan = shardlang.load(plan_path, world_size=dist.get_world_size())
    model_file = load_model_file(model_path)
    torch.manual_seed(seed)
    model = plan.build(model_file.build_model)
    return Context(plan, apply_plan(plan, model), model_file)


def checks_and_counts_against_handwritten(plan_path: str, model_path: str, hand: str) -> dict:
    """The plan's checks, and the collectives of one step of the plan's model and of the same model
    parallelised by hand-written torch code, counted the same way in the same run."""
    ctx = _applied(plan_path, model_path)
    results = combine(gather(run_checks(ctx, ctx.plan.checks)))
    torch.manual_seed(0)
    reference = ctx.model_file.build_model()
    globals()[hand](reference, ctx)
    return {
        "checks": [(r.check, r.status, r.message) for r in results],
        "plan_counts": count_collectives(ctx, ctx.model),
        "hand_counts": count_collectives(ctx, reference),
    }


def hand_tp_fsdp_integration(model, ctx) -> None:
    """test_fsdp_tp_extension_grad by hand, with FSDP2 for FSDP1."""
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(
        model,
        mesh["tp"],
        {"mlp.net1": ColwiseParallel(input_layouts=Shard(0)), "mlp.net2": RowwiseParallel(output_layouts=Shard(0))},
    )

    def prepare_input_fn(mod, inputs, device_mesh):
        return DTensor.from_local(inputs[0], device_mesh, [Shard(0)], run_check=False)

    def prepare_output_fn(mod, outputs, device_mesh):
        return outputs.to_local()

    distribute_module(model.mlp_norm, mesh["tp"], input_fn=prepare_input_fn, output_fn=prepare_output_fn)
    fully_shard(model.mlp, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def hand_loss_parallel(model, ctx) -> None:
    """test_loss_parallel's output layer by hand: logits sharded over the classes, left as a DTensor."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})


def cast_forward_inputs(plan_path: str, model_path: str) -> dict:
    """The dtype each recorder saw in one forward and backward (checkpointing recomputes c2)."""
    ctx = _applied(plan_path, model_path)
    x = ctx.model_file.example_input(4, torch.Generator().manual_seed(dist.get_rank()))
    ctx.model(x).float().sum().backward()
    return {
        name: [str(d).removeprefix("torch.") for d in module.seen]
        for name, module in (("root", ctx.model), ("c1", ctx.model.c1), ("c2", ctx.model.c2))
    }


def shared_parameters(plan_path: str, model_path: str) -> dict:
    """Shared parameters stay shared after sharding and are managed once."""
    ctx = _applied(plan_path, model_path)
    m = ctx.model
    blocks = m.blocks
    reference = ctx.model_file.build_model()
    return {
        "tied": blocks[0].in_proj.weight is blocks[1].in_proj.weight is blocks[2].in_proj.weight,
        "buffer_shared": blocks[1].buffer is blocks[2].buffer,
        "params": len(list(m.parameters())),
        "unique_params": len({id(p) for p in reference.parameters()}),
        "all_dtensors": all(isinstance(p, DTensor) for p in m.parameters()),
    }


def exact_uneven_chunks(plan_path: str, model_path: str) -> dict:
    """Each rank's local shard equals torch.chunk of the full tensor along dim 0 (empty if none)."""
    ctx = _applied(plan_path, model_path)
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = {}
    for name, p in ctx.model.named_parameters():
        full = p.full_tensor()
        chunks = torch.chunk(full, world, dim=0)
        expected = chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))
        local = p.to_local()
        assert local.shape == expected.shape and torch.equal(local, expected), (
            f"{name}: {tuple(local.shape)} vs {tuple(expected.shape)}"
        )
        shapes[name] = tuple(local.shape)
    return shapes


def forgot_to_materialise(plan_text: str, model_path: str) -> str:
    """A model built on meta under a plan without `init meta`: SL300 naming what is still on meta."""
    plan = shardlang.loads(plan_text)
    model_file = load_model_file(model_path)
    with torch.device("meta"):
        model = model_file.build_model()
    try:
        apply_plan(plan, model)
    except shardlang.PlanError as e:
        (d,) = e.diagnostics
        assert d.code == "SL300"
        return d.message
    raise AssertionError("apply accepted a model left on meta")


def weight_tying(plan_path: str, model_path: str) -> dict:
    """The tied weight stays one parameter after TP, and one training step gives both uses' gradient."""
    ctx = _applied(plan_path, model_path)
    m = ctx.model
    tokens = ctx.model_file.example_input(4, torch.Generator().manual_seed(0))
    m(tokens).sum().backward()
    return {
        "same_object": m.fc.weight is m.embedding.weight,
        "same_grad": m.fc.weight.grad is m.embedding.weight.grad,
        "placement": str(m.embedding.weight.placements),
    }
