"""Jobs for the expert-parallel tests: run on every rank of a worker pool (gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from shardlang.runtime.experts import ExpertParallel


def _experts(implementation: str, width: int = 8):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=width, num_experts=4, num_experts_per_tok=2)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
    return experts


def _routing(tokens: int, rank: int, only_first_rank: bool):
    g = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(tokens, 8, generator=g, requires_grad=True)
    scores = torch.rand(tokens, 4, generator=g)
    if only_first_rank:  # every token to the experts of rank 0: the other ranks receive nothing
        scores[:, 2:] = -1
    index = scores.topk(2, dim=-1).indices
    weights = torch.rand(tokens, 2, generator=g).softmax(-1).requires_grad_()
    upstream = torch.randn(tokens, 8, generator=g)
    return hidden, index, weights, upstream


def _differences(mine: tuple, whole: tuple) -> dict[str, float]:
    """The largest difference between the split experts' (output, tokens, routing weights) and the whole
    ones': of the outputs, and of the tokens' and the routing weights' gradients."""
    (out, hidden, weights), (o, h, w) = mine, whole
    return {
        "output": (out - o).abs().max().item(),
        "hidden_grad": (hidden.grad - h.grad).abs().max().item(),
        "weights_grad": (weights.grad - w.grad).abs().max().item(),
    }


def ep_matches_whole_experts(implementation: str = "eager", only_first_rank: bool = False) -> dict[str, float]:
    """Each rank routes its own tokens through experts split over ep = the world; compared with the whole
    experts run on every rank's tokens: the output, and the gradients of the inputs, of the routing weights
    and of this rank's experts (summed over every rank's tokens). The largest difference of each."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    whole = _experts(implementation)
    split = parallelize_module(_experts(implementation), mesh, ExpertParallel(shared_batch=False))

    hidden, index, weights, upstream = _routing(5 + rank, rank, only_first_rank)
    out = split(hidden, index, weights)
    (out * upstream).sum().backward()

    total = 0.0
    for source in range(world):
        h, i, w, u = _routing(5 + source, source, only_first_rank)
        o = whole(h, i, w)
        total = total + (o * u).sum()
        if source == rank:
            mine = (o, h, w)
    total.backward()
    errors = {**_differences((out, hidden, weights), mine), "experts_grad": 0.0}
    per_rank = 4 // world
    for name in ("gate_up_proj", "down_proj"):
        param = getattr(split, name)
        assert isinstance(param, DTensor) and param.to_local().shape[0] == per_rank
        block = getattr(whole, name).grad[rank * per_rank : (rank + 1) * per_rank]
        errors["experts_grad"] = max(errors["experts_grad"], (param.grad.to_local() - block).abs().max().item())
    return errors


def ep_without_weights_differs() -> float:
    """The planted mistake: tokens combined without their routing weights. How far the output is off."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    whole = _experts("eager")
    split = parallelize_module(_experts("eager"), mesh, ExpertParallel(shared_batch=False))
    hidden, index, weights, _ = _routing(5 + rank, rank, False)
    unweighted = split(hidden, index, torch.ones_like(weights))
    return (unweighted - whole(hidden, index, weights)).abs().max().item()


def stepped_split_and_whole(implementation: str, tokens: int, only_first_rank: bool):
    """The experts split over the world as one ep dim and the whole experts, each stepped once (forward and
    backward) on the same routing of `tokens` tokens (`_routing(tokens, 0, only_first_rank)`): (split, whole, the
    differences of the output and of the tokens' and routing weights' gradients)."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    whole = _experts(implementation)
    split = parallelize_module(_experts(implementation), mesh, ExpertParallel())
    hidden, index, weights, upstream = _routing(tokens, 0, only_first_rank)
    out = split(hidden, index, weights)
    (out * upstream).sum().backward()
    h, i, w, u = _routing(tokens, 0, only_first_rank)
    o = whole(h, i, w)
    (o * u).sum().backward()
    return split, whole, _differences((out, hidden, weights), (o, h, w))


def ep_shared_batch_matches_whole_experts(tokens: int) -> dict[str, float]:
    """Every rank holds the same `tokens` tokens (as tensor-parallel ranks do) and routes its slice of them:
    the output and every gradient equal the whole experts' on those tokens, with no token counted twice."""
    world, rank = dist.get_world_size(), dist.get_rank()
    split, whole, errors = stepped_split_and_whole("eager", tokens, False)
    per_rank = 4 // world
    for name in ("gate_up_proj", "down_proj"):
        block = getattr(whole, name).grad[rank * per_rank : (rank + 1) * per_rank]
        error = (getattr(split, name).grad.to_local() - block).abs().max().item()
        errors["experts_grad"] = max(errors.get("experts_grad", 0.0), error)
    return errors


def run_without_divided_expert_gradients(job):
    """`launch.job.run(job)` with the experts' units left to average their gradients over dp alone (the
    divide factor dp*ep not set): a planted fault."""
    from shardlang.launch.job import run
    from shardlang.runtime import units

    kept = units.divide_gradients
    units.divide_gradients = lambda unit, factor, mesh: None
    try:
        return run(job)
    finally:
        units.divide_gradients = kept


def etp_matches_whole_experts(implementation: str = "eager", fault: bool = False) -> dict[str, float]:
    """Every expert split by its intermediate width over tp = the world (ExpertTensorParallel), every rank
    holding the same tokens: the output, the gradients of the tokens and of the routing weights, and the
    experts' gradients (whole, from their shards) against the whole experts'. `fault`: the gradients of
    the inputs left partial (not summed over tp), the mistake the check must catch."""
    from shardlang.runtime import experts as runtime

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    # torch._grouped_mm takes strides of 16 bytes: 4 float32 columns of each expert per rank at least
    whole = _experts(implementation, width=16)
    if fault:
        runtime.SumGradOver, kept = _Identity, runtime.SumGradOver
    try:
        split = parallelize_module(_experts(implementation, width=16), mesh, runtime.ExpertTensorParallel())
        hidden, index, weights, upstream = _routing(6, 0, False)  # the same tokens on every rank
        out = split(hidden, index, weights)
        (out * upstream).sum().backward()
    finally:
        if fault:
            runtime.SumGradOver = kept
    h, _, w, _ = _routing(6, 0, False)
    o = whole(h, index, w)
    (o * upstream).sum().backward()
    errors = _differences((out, hidden, weights), (o, h, w))
    for name in ("gate_up_proj", "down_proj"):
        param = getattr(split, name)
        assert isinstance(param, DTensor) and param.to_local().shape[0] == 4
        errors[f"{name}_grad"] = (param.grad.full_tensor() - getattr(whole, name).grad).abs().max().item()
    return errors


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ListExperts(torch.nn.ModuleList):
    """A model's own experts: a ModuleList of torch MLPs (Linear, GELU, Linear), each token computed by its
    top-k experts and summed with their weights; an expert number out of range (a padding expert) adds
    nothing, as in transformers' Qwen3-Omni."""

    def __init__(self, experts: int = 4, hidden: int = 8, width: int = 16):
        nn = torch.nn
        super().__init__(
            [nn.Sequential(nn.Linear(hidden, width), nn.GELU(), nn.Linear(width, hidden)) for _ in range(experts)]
        )

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self):
            token, choice = torch.where(top_k_index == e)
            out = out.index_add(0, token, expert(hidden[token]) * top_k_weights[token, choice, None])
        return out


def _member_experts(kind: str):
    """Experts held as modules: transformers' SwitchTransformersExperts (an nn.ModuleDict of MLPs,
    top-1 one-hot routing with an expert capacity) or ListExperts; float64, the same on every rank."""
    torch.manual_seed(0)
    if kind == "list":
        return ListExperts().double()
    from transformers import SwitchTransformersConfig
    from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersExperts

    config = SwitchTransformersConfig(d_model=8, d_ff=16, num_experts=4, dropout_rate=0.0)
    return SwitchTransformersExperts(config).double()


def _member_routing(kind: str, tokens: int, seed: int, only_first_rank: bool):
    """(hidden, routing, weights, upstream) in `kind`'s form: the top-2 expert numbers with one padding
    choice (list), or top-1 one-hot rows [tokens, 1, 4] with one token over capacity (a row of zeros)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 8, generator=g, dtype=torch.float64, requires_grad=True)
    scores = torch.rand(tokens, 4, generator=g)
    if only_first_rank:
        scores[:, 2:] = -1
    upstream = torch.randn(tokens, 8, generator=g, dtype=torch.float64)
    if kind == "list":
        index = scores.topk(2, dim=-1).indices
        index[0, 1] = 4  # the padding expert
        weights = torch.rand(tokens, 2, generator=g, dtype=torch.float64).softmax(-1).requires_grad_()
        return hidden, index, weights, upstream
    one_hot = torch.nn.functional.one_hot(scores.argmax(-1), 4)[:, None, :]
    one_hot[-1] = 0  # over capacity: goes to no expert
    weights = torch.rand(tokens, 1, generator=g, dtype=torch.float64).requires_grad_()
    return hidden, one_hot, weights, upstream


def member_ep_matches_whole_experts(kind: str, shared: bool, tokens: int = 7, only_first_rank: bool = False):
    """Experts held as modules, split by member over ep = the world: this rank keeps its block of members
    under their own keys, and the output, the tokens' and routing weights' gradients and every kept
    member's gradients (summed over every rank's tokens) equal the whole experts'. `shared`: the ranks
    hold the same tokens and route a slice each; else each routes its own."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    whole = _member_experts(kind)
    split = parallelize_module(_member_experts(kind), mesh, ExpertParallel(shared_batch=shared))
    keys = list(whole._modules)
    per_rank = len(keys) // world
    assert list(split._modules) == keys[rank * per_rank : (rank + 1) * per_rank], list(split._modules)

    sources = [0] if shared else range(world)
    hidden, routing, weights, upstream = _member_routing(kind, tokens, 0 if shared else rank, only_first_rank)
    out = split(hidden, routing, weights)
    (out * upstream).sum().backward()
    total = 0.0
    for source in sources:
        h, r, w, u = _member_routing(kind, tokens, source, only_first_rank)
        o = whole(h, r, w)
        total = total + (o * u).sum()
        if source == (0 if shared else rank):
            mine = (o, h, w)
    total.backward()
    errors = {**_differences((out, hidden, weights), mine), "experts_grad": 0.0}
    for key, member in split._modules.items():
        for name, param in member.named_parameters():
            want = whole._modules[key].get_parameter(name).grad
            errors["experts_grad"] = max(errors["experts_grad"], (param.grad - want).abs().max().item())
    return errors


def member_ep_without_weights_differs(kind: str) -> float:
    """The planted mistake on experts held as modules: tokens combined without their routing weights."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    whole = _member_experts(kind)
    split = parallelize_module(_member_experts(kind), mesh, ExpertParallel(shared_batch=False))
    hidden, routing, weights, _ = _member_routing(kind, 7, rank, False)
    unweighted = split(hidden, routing, torch.ones_like(weights))
    return (unweighted - whole(hidden, routing, weights)).abs().max().item()


def placements_of_a_member_dropped_on_rank_0() -> tuple[str, str]:
    """plans/field/switch_ep_fsdp.sl applied at world 2 (ep 2), then rank 0 loses one of its members: the
    placements check's status and message on each rank."""
    from pathlib import Path

    import shardlang
    from shardlang.runtime.apply import apply_plan
    from shardlang.runtime.modelfile import load_model_file
    from shardlang.verification import Context, placements

    root = Path(__file__).resolve().parent.parent
    plan = shardlang.load(root / "plans" / "field" / "switch_ep_fsdp.sl", world_size=2)
    model_file = load_model_file(str(root / "examples" / "field" / "switch.py"))
    torch.manual_seed(0)
    applied = apply_plan(plan, model_file.build_model())
    if dist.get_rank() == 0:
        del applied.model.get_submodule("encoder.block.0.layer.1.mlp.experts")._modules["expert_0"]
    outcome = placements.run(Context(plan, applied, model_file), None)
    return outcome.status, outcome.message


class CountedExperts(torch.nn.Module):
    """Experts in torchtitan's convention, in plain torch (no torchtitan needed): weights stacked by expert
    (`w1` [experts, width, hidden], `w2` [experts, hidden, width]), `num_experts`, and a forward that takes
    the rows already grouped by expert with each expert's count, `forward(x [rows, hidden], counts
    [experts])`, as torchtitan's GroupedExperts does with a grouped matmul; a loop here, float64."""

    def __init__(self, experts: int = 4, hidden: int = 8, width: int = 6):
        super().__init__()
        torch.manual_seed(0)
        self.num_experts = experts
        self.w1 = torch.nn.Parameter(torch.randn(experts, width, hidden, dtype=torch.float64) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(experts, hidden, width, dtype=torch.float64) * 0.3)

    def forward(self, x, counts):
        listed = isinstance(counts, list)  # JetMoE's convention: a list of ints
        assert len(counts) == self.w1.shape[0] if listed else counts.shape == (self.w1.shape[0],), counts
        chunks = x.split(counts if listed else counts.tolist())
        return torch.cat([torch.tanh(c @ w1.T) @ w2.T for c, w1, w2 in zip(chunks, self.w1, self.w2)])


def _grouped_rows(tokens: int, seed: int, experts: int = 4, only_first_rank: bool = False):
    """(rows grouped by expert, each expert's count, upstream gradient): `tokens` x top-2 rows, as
    torchtitan's dispatcher sorts them."""
    g = torch.Generator().manual_seed(200 + seed)
    choice = torch.randint(0, experts // 2 if only_first_rank else experts, (tokens * 2,), generator=g)
    counts = torch.bincount(choice, minlength=experts)
    rows = torch.randn(tokens * 2, 8, generator=g, dtype=torch.float64)
    rows = rows[torch.argsort(choice, stable=True)].requires_grad_()
    return rows, counts, torch.randn(tokens * 2, 8, generator=g, dtype=torch.float64)


def counted_ep_matches_whole_experts(
    shared: bool, tokens: int = 5, only_first_rank: bool = False, listed: bool = False
):
    """Experts that take their rows grouped by expert with the counts (CountedExperts), split over ep = the
    world: each rank's rows (its own, or its slice of rows every rank holds alike) go to the ranks holding
    their experts and back. The output, the rows' gradient and this rank's experts' gradients (summed over
    every rank's rows) equal the whole experts'. The largest difference of each. `listed`: the counts
    given as a list of ints (JetMoE's experts), the local ones handed on as one too."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    whole = CountedExperts()
    split = parallelize_module(CountedExperts(), mesh, ExpertParallel(shared_batch=shared))
    assert split.num_experts == 4 and split.w1.to_local().shape[0] == 4 // world
    sources = [0] if shared else range(world)
    rows, counts, upstream = _grouped_rows(tokens + (0 if shared else rank), 0 if shared else rank, 4, only_first_rank)
    out = split(rows, counts.tolist() if listed else counts)
    (out * upstream).sum().backward()
    errors = {"output": 0.0, "rows_grad": 0.0}
    for source in sources:
        r, c, u = _grouped_rows(tokens + (0 if shared else source), source, 4, only_first_rank)
        o = whole(r, c)
        (o * u).sum().backward()
        if source == (0 if shared else rank):
            errors = {"output": (out - o).abs().max().item(), "rows_grad": (rows.grad - r.grad).abs().max().item()}
    per_rank = 4 // world
    for name in ("w1", "w2"):
        block = getattr(whole, name).grad[rank * per_rank : (rank + 1) * per_rank]
        error = (getattr(split, name).grad.to_local() - block).abs().max().item()
        errors["experts_grad"] = max(errors.get("experts_grad", 0.0), error)
    return errors


def run_with_one_rank_units_divided_twice(job):
    """`launch.job.run(job)` with the experts' units divided as before issue 39: the factor set and, on gloo,
    the reduction forced to a sum whatever the unit's size. On a unit over one rank (dp of size 1) FSDP2
    then divides by the factor twice: a planted fault."""
    from shardlang.launch.job import run
    from shardlang.runtime import units

    def divided_twice(unit, factor, mesh):
        unit = unit[0] if isinstance(unit, list) else unit
        unit.set_gradient_divide_factor(float(factor))
        unit.set_force_sum_reduction_for_comms(True)

    kept = units.divide_gradients
    units.divide_gradients = divided_twice
    try:
        return run(job)
    finally:
        units.divide_gradients = kept


def run_with_experts_blind_to_replicate(job):
    """`launch.job.run(job)` with the experts' forward blind to the DTensors DDP's replicate rebuilds from
    their local parameters for each forward (left as DTensors beside the local rows): a planted fault."""
    from shardlang.launch.job import run
    from shardlang.runtime import experts

    kept = experts._rebuilt_by_replicate
    experts._rebuilt_by_replicate = lambda module: {}
    try:
        return run(job)
    finally:
        experts._rebuilt_by_replicate = kept
