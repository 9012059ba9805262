"""Jobs the distributed tests run on every rank of a worker pool, and the hand-written torch code each
plan is compared with. Everything here runs inside a worker process with an initialised gloo group."""

from __future__ import annotations

import importlib
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import shardlang
from shardlang.runtime.apply import apply_plan
from shardlang.runtime.ownstyles import distribute_with_layouts
from shardlang.runtime.torchcompat import composable_checkpoint, composable_replicate


def load(ref: str):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name or "build_model")


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def describe(p) -> str:
    if isinstance(p, DTensor):
        return f"{p.device_mesh.mesh_dim_names} {tuple(p.placements)}"
    return "plain"


# --- inputs ------------------------------------------------------------------------------------


@attrs.frozen
class features:
    """Random inputs (batch, [seq,] dim): the same on the ranks of one data-parallel group (`dp` groups
    of consecutive ranks), and each TP rank's own slice along `shard_dim` if given."""

    dim: int
    batch: int = 4
    seq: int | None = None
    shard_dim: int | None = None
    dp: int = 1

    def __call__(self, r: int, w: int):
        tp = w // self.dp
        g = torch.Generator().manual_seed(100 + r // tp)
        shape = (self.batch, self.seq, self.dim) if self.seq else (self.batch, self.dim)
        x = torch.randn(*shape, generator=g)
        return x.chunk(tp, dim=self.shard_dim)[r % tp] if self.shard_dim is not None else x


@attrs.frozen
class tokens:
    vocab: int
    batch: int = 4
    seq: int = 5

    def __call__(self, r: int, w: int):
        return torch.randint(0, self.vocab, (self.batch, self.seq), generator=torch.Generator().manual_seed(7))


# --- the comparison job -------------------------------------------------------------------------


def same_as_handwritten(plan_text: str, model: str, hand: str, make_input, params=None, steps: int = 2) -> dict:
    """Apply the plan to one copy of the model and the hand-written calls to another, then require the
    same parameter types, meshes, placements and local shards, and the same outputs and gradients for
    `steps` forward/backward passes. Also requires the actual placements to equal the prediction."""
    plan = shardlang.loads(plan_text, params)
    build = load(model)
    torch.manual_seed(0)
    a = plan.build(build)
    applied = apply_plan(plan, a)
    torch.manual_seed(0)
    b = build()
    load(hand)(b)

    names_a = [n for n, _ in a.named_parameters()]
    names_b = [n for n, _ in b.named_parameters()]
    assert names_a == names_b, (names_a, names_b)
    assert [type(m).__name__ for m in a.modules()] == [type(m).__name__ for m in b.modules()]
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert describe(pa) == describe(pb), f"{name}: shardlang {describe(pa)} vs hand-written {describe(pb)}"
        assert torch.equal(local(pa), local(pb)), f"{name}: local shards differ"
    for (name, ba), bb in zip(a.named_buffers(), b.buffers()):
        assert torch.equal(local(ba), local(bb)), f"buffer {name} differs"

    for step in range(steps):
        x = make_input(rank(), world())
        out_a, out_b = a(x), b(x)
        assert torch.equal(local(out_a), local(out_b)), f"step {step}: outputs differ"
        local(out_a).float().sum().backward()
        local(out_b).float().sum().backward()
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert (pa.grad is None) == (pb.grad is None), f"{name}: one gradient is missing"
            if pa.grad is not None:
                assert torch.equal(local(pa.grad), local(pb.grad)), f"step {step}: gradient of {name} differs"

    actual = {n: describe(p) for n, p in a.named_parameters()}
    predicted = applied.predictions
    for name, _p in a.named_parameters():
        expect = predicted[name]
        if expect.known and expect.mesh is None:
            assert actual[name] == "plain", f"{name}: predicted a plain tensor, got {actual[name]}"
        elif expect.known:
            want = f"{expect.dims} {tuple(_torch_placement(x) for x in expect.placements)}"
            assert actual[name] == want, f"{name}: predicted {want}, got {actual[name]}"
    return actual


def _torch_placement(p):
    from shardlang.frontend import ir
    from shardlang.runtime.torchcompat import strided_shard_class

    if isinstance(p, ir.StridedShard):
        return strided_shard_class()(p.dim, split_factor=p.split_factor)
    return {ir.Replicate: Replicate()}.get(type(p)) or Shard(p.dim)


# --- hand-written equivalents -------------------------------------------------------------------


def mesh1(name="tp"):
    return init_device_mesh("cpu", (world(),), mesh_dim_names=(name,))


def mesh2(names=("dp", "tp"), inner=2):
    return init_device_mesh("cpu", (world() // inner, inner), mesh_dim_names=names)


def hand_mlp_tp(model):
    parallelize_module(model, mesh1(), {"net1": ColwiseParallel(), "net2": RowwiseParallel()})


def hand_seq_mlp(model):
    tp = mesh1()
    parallelize_module(
        model,
        tp,
        {
            "norm": SequenceParallel(),
            "mlp.w1": ColwiseParallel(input_layouts=Shard(1)),
            "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
        },
    )


def hand_rmsnorm(model):
    tp = mesh1()
    parallelize_module(
        model,
        tp,
        {"mlp.net1": ColwiseParallel(input_layouts=Shard(0)), "mlp.net2": RowwiseParallel(output_layouts=Shard(0))},
    )

    def prepare_input_fn(mod, inputs, device_mesh):
        return DTensor.from_local(inputs[0], device_mesh, [Shard(0)], run_check=False)

    def prepare_output_fn(mod, outputs, device_mesh):
        return outputs.to_local()

    from torch.distributed.tensor import distribute_module

    distribute_module(model.mlp_norm, tp, input_fn=prepare_input_fn, output_fn=prepare_output_fn)


def hand_embed_colwise(model):
    parallelize_module(model, mesh1(), {"embedding": ColwiseParallel(), "fc": RowwiseParallel()})


def hand_embed_rowwise(model):
    parallelize_module(model, mesh1(), {"embedding": RowwiseParallel(), "fc": ColwiseParallel()})


def hand_tied(model):
    parallelize_module(model, mesh1(), {"embedding": ColwiseParallel(), "fc": RowwiseParallel()})
    model.fc.weight = model.embedding.weight


def hand_2d(model):
    mesh = mesh2()
    parallelize_module(model, mesh["tp"], {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])


def hand_hsdp(model):
    mesh = mesh2(("replicate", "shard"))
    for unit in (model.u1, model.u2):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


def hand_mixed_precision(model):
    mesh = mesh1("dp")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model.u1, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model.u2, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def hand_replicate_and_fully_shard(model):
    mesh = mesh1("dp")
    composable_replicate()(model.u1, device_mesh=mesh)
    fully_shard(model.u2, mesh=mesh)
    fully_shard(model, mesh=mesh)


def hand_checkpoint_fully_shard(model):
    mesh = mesh1("dp")
    for unit in (model.u1, model.u2):
        composable_checkpoint()(unit)
    for unit in (model.u1, model.u2):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


def hand_options(model):
    mesh = mesh1("dp")
    fully_shard(model.u1[0], mesh=mesh, reshard_after_forward=2)
    fully_shard(model.u1[2], mesh=mesh, reshard_after_forward=False)
    fully_shard(model.u2, mesh=mesh, reshard_after_forward=True, offload_policy=CPUOffloadPolicy(pin_memory=False))
    composable_replicate()(model.head, device_mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)


def hand_prepare_output(model):
    tp = mesh1()
    parallelize_module(
        model,
        tp,
        {
            "mlp": PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate()),
            "mlp.w1": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=Partial()),
        },
    )
    parallelize_module(model.mlp, tp, PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Shard(0)))
    parallelize_module(model, tp, {"norm": SequenceParallel(sequence_dim=0, use_local_output=True)})


def hand_user_styles(model):
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    from examples.styles import rowwise_scaled

    mesh = mesh1()
    parallelize_module(model, mesh, {"net1": ColwiseParallel()})
    rowwise_scaled(model.net2, mesh, scale=0.5)
    parallelize_module(
        model,
        mesh,
        PrepareModuleInputOutput(
            input_layouts=Replicate(),
            desired_input_layouts=Replicate(),
            output_layouts=Replicate(),
            desired_output_layouts=Replicate(),
        ),
    )


def hand_distribute_output(model):
    tp = mesh1()
    distribute_with_layouts(model.norm, tp, Replicate(), Replicate())
    parallelize_module(model, tp, {"mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel()})


# --- other jobs --------------------------------------------------------------------------------


def meta_init_matches_unsharded(plan_text: str, model: str, seed: int = 1234) -> dict:
    """`init meta`: every shard gets its own values, and the whole equals an unsharded model
    initialised with the same seed (reset_parameters on each module in order)."""
    plan = shardlang.loads(plan_text)
    build = load(model)
    torch.manual_seed(seed)
    sharded = plan.build(build)
    apply_plan(plan, sharded)
    torch.manual_seed(seed)
    reference = build()
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in reference.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
    report = {}
    for (name, p), ref in zip(sharded.named_parameters(), reference.parameters()):
        assert p.device.type == "cpu", f"{name} is on {p.device}"
        full = p.full_tensor() if isinstance(p, DTensor) else p
        assert torch.equal(full, ref), f"{name}: sharded init differs from the unsharded one"
        report[name] = describe(p)
        # Shards of one tensor must not repeat each other (DTensor's CPU RNG would make them equal).
        if isinstance(p, DTensor) and not all(pl.is_replicate() for pl in p.placements):
            mine = local(p).detach().flatten()
            sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world())]
            dist.all_gather(sizes, torch.tensor([mine.numel()]))
            if len({int(n) for n in sizes}) == 1 and mine.numel() > 1:
                gathered = [torch.empty_like(mine) for _ in range(world())]
                dist.all_gather(gathered, mine)
                assert len({tuple(t.tolist()) for t in gathered}) > 1, f"{name}: every shard holds the same values"
    return report


def rank0_init_is_bitwise(plan_text: str, model: str) -> dict:
    """`init rank0`: the sharded model equals rank 0's unsharded model bitwise, buffers included."""
    plan = shardlang.loads(plan_text)
    build = load(model)
    torch.manual_seed(rank() + 10)  # ranks build different models: only rank 0's may count
    sharded = plan.build(build)
    reference = [t.clone() for t in sharded.state_dict().values()] if rank() == 0 else None
    buffers = {n: b.clone() for n, b in sharded.named_buffers()} if rank() == 0 else None
    apply_plan(plan, sharded)
    objects = [reference, buffers]
    dist.broadcast_object_list(objects, src=0)
    reference, buffers = objects
    for (name, t), ref in zip(sharded.state_dict().items(), reference):
        full = t.full_tensor() if isinstance(t, DTensor) else t
        assert torch.equal(full.cpu(), ref), f"{name} differs from rank 0's model"
    for name, b in sharded.named_buffers():
        assert torch.equal(local(b).cpu(), buffers[name]), f"buffer {name} differs from rank 0's"
    return {n: describe(p) for n, p in sharded.named_parameters()}


def sync_makes_replicas_equal(plan_text: str, model: str, dim: str) -> list:
    """Build with a different seed per rank, apply, then compare every replicated tensor's local values
    across the groups of mesh dim `dim`: True per tensor that agrees on all ranks of its group."""
    plan = shardlang.loads(plan_text)
    torch.manual_seed(rank())
    model_ = plan.build(load(model))
    applied = apply_plan(plan, model_)
    group = applied.meshes["world"].get_group(dim)
    agree = []
    for tensor in [*model_.parameters(), *model_.buffers()]:
        if isinstance(tensor, DTensor):
            names = tensor.device_mesh.mesh_dim_names
            if dim in names and not tensor.placements[names.index(dim)].is_replicate():
                continue  # sharded along `dim`: each rank rightly holds its own piece
        mine = local(tensor).detach().float().flatten()
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        agree.append(all(torch.equal(gathered[0], g) for g in gathered))
    return agree


def failing_apply_leaves_model_unchanged(plan_text: str, model: str) -> str:
    """A step that fails mid-program: PlanError(SL300) on every rank and the model exactly as before."""
    plan = shardlang.loads(plan_text)
    torch.manual_seed(0)
    m = plan.build(load(model))
    before, before_values = _fingerprint(m), _values(m)
    try:
        apply_plan(plan, m)
    except shardlang.PlanError as e:
        (d,) = e.diagnostics
        assert d.code == "SL300", d
        after = _fingerprint(m)
        for key in before:
            assert before[key] == after[key], f"{key} changed by a failed apply"
        for (name, value), (_, now) in zip(before_values, _values(m)):
            assert torch.equal(value, now), f"the value of {name} changed by a failed apply"
        if next(m.parameters()).device.type != "meta":
            m(torch.randn(2, 8)).sum().backward()  # still a working, unsharded model
        return d.message
    raise AssertionError("apply did not fail")


def _values(model: nn.Module) -> list:
    return [
        (n, t.detach().clone())
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if t.device.type != "meta"
    ]


def _fingerprint(model: nn.Module) -> dict:
    from shardlang.runtime.torchcompat import composable_state_mapping

    mapping = composable_state_mapping()
    return {
        "types": [type(m) for m in model.modules()],
        "params": [
            (n, id(p), type(p), p.device, p.shape, p.data.data_ptr() if p.device.type != "meta" else 0)
            for n, p in model.named_parameters()
        ],
        "buffers": [(n, id(b), b.device) for n, b in model.named_buffers()],
        "hooks": [
            (
                len(m._forward_hooks),
                len(m._forward_pre_hooks),
                len(m._backward_hooks),
                len(m._state_dict_hooks),
                len(m._load_state_dict_pre_hooks),
            )
            for m in model.modules()
        ],
        "dict_keys": [sorted(m.__dict__) for m in model.modules()],
        "composable": [m in mapping for m in model.modules()] if mapping is not None else None,
    }


def raise_after_change(module, mesh, **kwargs):
    """A user style that changes its module, then fails."""
    parallelize_module(module, mesh, ColwiseParallel())
    raise RuntimeError("planted failure in a user style")


def applied_both_ways(plan_text: str, build, world_size: int, with_model: bool = True):
    """The model from `build` sharded by apply and, from the same seed, by the code `compile --emit python`
    prints for the plan (compiled for the model, or with `with_model` False for any model)."""
    plan = shardlang.loads(plan_text)
    with torch.device("meta"):
        meta_model = build()
    code = plan.to_python(meta_model, world_size) if with_model else plan.to_python()
    namespace: dict = {}
    # dont_inherit: as a file of its own, without this module's `from __future__ import annotations`
    exec(compile(code, "<emitted>", "exec", dont_inherit=True), namespace)
    torch.manual_seed(0)
    applied = plan.build(build)
    apply_plan(plan, applied)
    torch.manual_seed(0)
    printed = namespace["build"](build)
    namespace["apply_plan"](printed)
    return applied, printed


def emitted_code_matches_apply(plan_text: str, model: str, world_size: int, with_model: bool = True) -> dict:
    """The code `compile --emit python` prints, run on its own, gives the placements and shards apply
    gives: compiled for the model, or (`with_model` False) for any model, matching targets as it runs."""
    a, b = applied_both_ways(plan_text, load(model), world_size, with_model)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert describe(pa) == describe(pb), f"{name}: apply {describe(pa)} vs emitted {describe(pb)}"
        assert torch.equal(local(pa), local(pb)), f"{name}: shards differ"
    return {n: describe(p) for n, p in a.named_parameters()}


def loss_parallel_matches_unsharded(plan_text: str) -> float:
    """`loss_parallel`: cross-entropy on class-sharded logits equals the unsharded loss, and so do the
    gradients, with the plan's output layer and with the hand-written one."""
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    from tests.models import LossHead

    plan = shardlang.loads(plan_text)
    assert plan.loss_parallel is not None
    torch.manual_seed(0)
    reference = LossHead()
    torch.manual_seed(0)
    a = plan.build(LossHead)
    apply_plan(plan, a)
    torch.manual_seed(0)
    b = LossHead()
    parallelize_module(b, mesh1(), {"output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    target = torch.randint(0, 16, (6,), generator=torch.Generator().manual_seed(4))
    expected = F.cross_entropy(reference(x), target)
    expected.backward()
    for model in (a, b):
        logits = model(x)
        assert isinstance(logits, DTensor) and logits.placements[0].is_shard(logits.ndim - 1)
        with loss_parallel():
            loss = F.cross_entropy(logits, target)
            loss.backward()
        torch.testing.assert_close(loss.full_tensor(), expected)
        torch.testing.assert_close(model.output.weight.grad.full_tensor(), reference.output.weight.grad)
    return float(expected)


def library_verify(plan_text: str) -> tuple:
    """shardlang.verify inside an initialised process group: every rank gets the same report."""
    from examples.mlp import build_model, example_input

    report = shardlang.verify(shardlang.loads(plan_text), build_model, example_input)
    return report.ok, tuple((c.check, c.ok) for c in report.checks)


def local_facts(plan_path: str, model_path: str) -> dict:
    """What this rank really holds after apply (local shapes, bytes) and sends in one step (counts)."""
    from shardlang.runtime.modelfile import load_model_file
    from shardlang.verification import Context
    from shardlang.verification.comms import count_collectives

    plan = shardlang.load(plan_path)
    model_file = load_model_file(model_path)
    torch.manual_seed(0)
    model = plan.build(model_file.build_model)
    applied = apply_plan(plan, model)
    seen, shapes, param_bytes = set(), {}, 0
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            piece = local(tensor)
            shapes[name] = (tuple(piece.shape), piece.numel() * piece.element_size())
            if kind == "parameter":
                param_bytes += piece.numel() * piece.element_size()
    counts = count_collectives(Context(plan, applied, model_file), model)
    return {"shapes": shapes, "param_bytes": param_bytes, "counts": counts}


def transformers_styles_shard_as_transformers_does(plan_text: str) -> dict:
    """plans/transformers_styles.sl (init auto here, so every rank builds the reference's values): each
    tensor's local shard is the slice of the unsharded model's that transformers' style gives its rank
    (packed_colwise: the k-th slice of gate and of up; the Conv1D styles: columns, then rows), the
    printed program places and fills every shard as apply does (for the model and for any model), and a
    plain colwise on the packed layer fails the gradients check."""
    from examples.fused import build_model
    from shardlang.launch.job import Job, run

    plan = shardlang.loads(plan_text)
    torch.manual_seed(0)
    reference = build_model()
    torch.manual_seed(0)
    model = plan.build(build_model)
    apply_plan(plan, model)
    mesh = model.mlp.gate_up.weight.device_mesh
    dp, tp = mesh.get_coordinate()
    dp_size, tp_size = mesh.size(0), mesh.size(1)

    def expect(name, want):
        got = local(model.get_parameter(name))
        assert torch.equal(got, want), f"{name}: rank {rank()} holds the wrong slice"

    gate, up = reference.mlp.gate_up.weight.detach().chunk(2)
    rows = torch.cat([gate.chunk(tp_size)[tp], up.chunk(tp_size)[tp]])
    expect("mlp.gate_up.weight", rows.chunk(dp_size, dim=1)[dp])  # FSDP shards a packed weight on dim 1
    expect("mlp.gate_up.bias", reference.mlp.gate_up.bias.detach().chunk(dp_size)[dp])  # whole over tp
    expect("ffn.fc.weight", reference.ffn.fc.weight.detach().chunk(tp_size, dim=1)[tp].chunk(dp_size)[dp])
    expect("ffn.proj.weight", reference.ffn.proj.weight.detach().chunk(tp_size)[tp].chunk(dp_size)[dp])
    expect("attn.head_norm.weight", reference.attn.head_norm.weight.detach().chunk(dp_size)[dp])
    placements = {n: describe(p) for n, p in model.named_parameters()}
    emitted = [emitted_code_matches_apply(plan_text, "examples.fused:build_model", world(), m) for m in (True, False)]
    assert emitted[0] == emitted[1] == placements
    plain = shardlang.loads(plan_text.replace("packed_colwise(parts=2)", "colwise"))
    gradients = shardlang.loads("verify gradients").checks
    report = run(Job(plain, {}, str(Path(__file__).parent.parent / "examples" / "fused.py"), None, gradients))
    return {"placements": placements, "plain_colwise": [(c.check, c.status) for c in report.checks]}


def gathered_matches_full_tensor() -> list:
    """runtime.gathering.gather_by_hand (full_tensor by hand, for layouts torch 2.11 cannot redistribute)
    against full_tensor and the tensor itself, on a 2 x 2 mesh: even and uneven shards, strided shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from shardlang.runtime.gathering import gather_by_hand

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    results = []
    for shape, placements in [
        ((8, 6), (Shard(1), _StridedShard(0, split_factor=2))),  # FSDP's dim 1 over a packed TP weight
        ((8, 6), (_StridedShard(0, split_factor=2), Shard(0))),  # FSDP over TP on the same dim
        ((7, 5), (Shard(0), Shard(1))),  # uneven
        ((6,), (Replicate(), Shard(0))),
    ]:
        whole = torch.randn(shape)
        tensor = distribute_tensor(whole, mesh, placements)
        try:
            by_torch = torch.equal(tensor.full_tensor(), whole)
        except ValueError:  # torch 2.11 cannot plan the first layout's redistribution
            by_torch = None
        results.append((str(placements), torch.equal(gather_by_hand(tensor), whole), by_torch))
    return results


def scatter_matches_torchs_broadcast() -> bool:
    """runtime.rank0.scatter_from_rank0 (for shards FSDP pinned on the CPU of a GPU mesh) loads what
    torch's set_model_state_dict(broadcast_from_rank0) loads, on a 2 x 2 mesh with FSDP over TP (ours is
    handed rank0_values, every parameter and buffer by name; torch the state dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    import shardlang
    from examples.llama import build_model
    from shardlang.runtime.rank0 import rank0_values, scatter_from_rank0

    torch.manual_seed(0)
    built = build_model()
    full = built.state_dict()
    plan = "mesh world = cpu[dp=2, tp=2]\nparallelize on world.tp { layers.*.attention.wq : colwise }\n"
    plan += "fully_shard on world.dp { each layers.* }\n"
    ours, theirs = shardlang.loads(plan).apply(build_model()), shardlang.loads(plan).apply(build_model())
    if not any(isinstance(t, DTensor) for t in ours.state_dict().values()):
        return False
    given = full if dist.get_rank() == 0 else {}
    scatter_from_rank0(ours, "cpu", rank0_values(built) if dist.get_rank() == 0 else {})
    set_model_state_dict(theirs, given, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    mine, torchs = ours.state_dict(), theirs.state_dict()
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in mine.items()}
    return mine.keys() == torchs.keys() and all(
        torch.equal(local[k], torchs[k].to_local() if isinstance(torchs[k], DTensor) else torchs[k]) for k in mine
    )
