"""Jobs for the context-parallel tests: run on every rank of a worker pool (gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlang.runtime.context_attention import ContextParallelAttention
from shardlang.runtime.context_layout import LAYOUTS, Contiguous, HeadTail, SequenceLayout


class Striped(SequenceLayout):
    """A load balancer of the tests' own, plugged in as one class: 2 x ranks chunks, rank r holding chunks
    r and r + ranks (neither head-tail's nor the plain split's positions)."""

    name = "striped"

    @property
    def parts(self) -> int:
        return 2 * self.ranks

    def chunks(self, rank: int) -> tuple[int, ...]:
        return (rank, rank + self.ranks)

    def describe(self) -> str:
        return f"2 x {self.ranks} ranks, striped"


def striped_plan_applied(job) -> object:
    """`shardlang apply`'s job (launch.job.run) with `load_balance = striped` known to the plan language
    and the runtime (Striped registered for the run, then removed)."""
    from shardlang.frontend import schema
    from shardlang.launch.job import run

    options, before = schema.CONTEXT_OPTIONS, schema.CONTEXT_OPTIONS["load_balance"]
    options["load_balance"] = schema.choice(*schema.LOAD_BALANCERS, Striped.name, what="load balancing")
    LAYOUTS[Striped.name] = Striped
    try:
        return run(job)
    finally:
        options["load_balance"] = before
        del LAYOUTS[Striped.name]


def attention_matches_whole(causal: bool, kind: type[SequenceLayout], gqa: bool = False) -> dict[str, float]:
    """Each rank's shard of q, k and v (batch 2, heads 4, sequence 16, head dim 8), laid out by `kind`,
    through SDPA under ContextParallelAttention; the output and the gradients of q, k and v, joined back
    in sequence order, against SDPA on the whole sequence: the largest difference of each."""
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = kind(world)
    g = torch.Generator().manual_seed(0)
    kv_heads = 2 if gqa else 4
    q = torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, 16, 8, generator=g, dtype=torch.float64) for _ in range(2))
    upstream = torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float64)
    kwargs = {"is_causal": causal, **({"enable_gqa": True} if gqa else {})}

    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*whole, **kwargs)
    (out * upstream).sum().backward()

    mine = [layout.split(t, 2, rank).requires_grad_() for t in (q, k, v)]
    with ContextParallelAttention(dist.group.WORLD, layout):
        local = F.scaled_dot_product_attention(*mine, **kwargs)
    (local * layout.split(upstream, 2, rank)).sum().backward()

    def joined(t: torch.Tensor) -> torch.Tensor:
        shards = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(shards, t.contiguous())
        return layout.join(shards, 2)

    return {
        "output": float((joined(local.detach()) - out.detach()).abs().max()),
        **{f"{name}_grad": float((joined(m.grad) - w.grad).abs().max()) for name, m, w in zip("qkv", mine, whole)},
    }


def mask_of_the_other_layout() -> dict[str, float]:
    """Shards cut plainly, attention told they are head-tail: the output differs from the whole's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    plain = Contiguous(world)
    mine = [plain.split(t, 2, rank) for t in (q, k, v)]
    with ContextParallelAttention(dist.group.WORLD, HeadTail(world)):
        local = F.scaled_dot_product_attention(*mine, is_causal=True)
    shards = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(shards, local.contiguous())
    return {"output": float((plain.join(shards, 2) - out).abs().max())}


def printed_program_runs_like_apply(plan_text: str) -> float:
    """plans/llama_cp.sl's printed program, on its own: the loss of one forward on whole sequences equals
    the unsharded model's (the program splits, attends over cp and gathers as apply does)."""
    import copy

    import shardlang
    from examples.llama import build_model, causal_lm_loss, example_input

    text = plan_text.replace("init meta", "").replace("mixed_precision(param=bf16, reduce=fp32)", "")
    plan = shardlang.loads(text, world_size=dist.get_world_size())
    torch.manual_seed(0)
    model = build_model()
    whole = copy.deepcopy(model)
    namespace: dict = {}
    exec(compile(plan.to_python(model, dist.get_world_size()), "printed.py", "exec", dont_inherit=True), namespace)
    sharded = namespace["apply_plan"](model)
    tokens = example_input(2, torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float((causal_lm_loss(sharded(tokens), tokens) - causal_lm_loss(whole(tokens), tokens)).abs())


def local_output_and_its_labels(plan_text: str) -> dict:
    """Under `output = local` the applied model returns this rank's shard of the logits, and
    Plan.context_shard cuts the labels alike: the mean of the ranks' local losses (what FSDP's averaging
    over cp makes of their gradients) is the whole sequence's loss."""
    import shardlang
    from examples.llama import build_model, example_input
    from shardlang.runtime.apply import apply_plan

    text = plan_text.replace("init meta", "").replace("mixed_precision(param=bf16, reduce=fp32)", "")
    plan = shardlang.loads(text, world_size=dist.get_world_size())
    torch.manual_seed(0)
    whole_model = build_model()
    torch.manual_seed(0)
    model = apply_plan(plan, build_model()).model
    tokens = example_input(2, torch.Generator().manual_seed(1))
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)
    with torch.no_grad():
        local = model(tokens)
        mine = F.cross_entropy(local.flatten(0, 1), plan.context_shard(model, labels).flatten(), ignore_index=-100)
        whole = F.cross_entropy(whole_model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)
    every = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine.reshape(()))
    return {"shape": tuple(local.shape), "mean_of_local": float(torch.stack(every).mean()), "whole": float(whole)}
