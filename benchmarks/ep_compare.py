"""shardlang's `expert_parallel` against expert parallelism written by hand with torch, on transformers' own
MixtralForCausalLM of about 1.2B parameters (16 layers, hidden 1024, 8 experts of width 2816, top 2), EP
over every GPU: both models built in one run and trained alternately after warm-up; median step time,
tokens/s and peak memory per side, and the collectives of one forward+backward of each.

    torchrun --nproc-per-node 2 benchmarks/ep_compare.py            # three runs: the median of their ratios
    torchrun --nproc-per-node 2 benchmarks/ep_compare.py --dry-run --steps 2 --warmup 1   # CPU, gloo, tiny
    torchrun --nproc-per-node 4 benchmarks/ep_compare.py --fsdp     # EP 2 x FSDP 2: experts borrowing dp

The same work on both sides. The ranks share their batch (4 x 1024 tokens, the same on every rank), as in
plans/hf/mixtral_ep.sl, which shardlang applies (`benchmarks/plans/mixtral_ep.sl`: the same rule): each rank
routes its contiguous slice of the tokens, every (token, choice) pair goes to the rank holding its expert by
an all-to-all (grouped by expert after one of each expert's count, so that each row's expert needs no
exchange of its own), the experts module's own forward (transformers' grouped matmul) runs the local
experts, a second all-to-all brings the results back, the routing weights are applied on the sending rank and the
slices are gathered back whole. The hand-written side does exactly that with torch's collectives
(`hand_written_ep` below: an autograd function for the slice and the gather), in two versions: `hand`
keeps each rank's experts as ordinary parameters; `hand_dtensor` keeps them as Shard(0) DTensors, as
shardlang and torchtitan do (the parameters' global view, for checkpoints and the optimizer), and takes
`to_local()` of them in each forward. The router, attention, norms and embeddings are whole on all. bf16 parameters, AdamW
(lr 1e-4), no gradient reduction (every rank computes the same gradients for what is whole).

Measurement: `--warmup` steps of each, then `--steps` steps alternating (even steps shardlang first), each
timed from a barrier to the GPUs' synchronisation; a step's time is the slowest rank's, the median per
side. Peak memory: torch.cuda.max_memory_allocated over a step minus what was allocated before it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: hand: the experts as plain local parameters; hand_dtensor: the same code with the experts kept as Shard(0)
#: DTensors (a global view for checkpoints and optimizers, as torchtitan keeps them), taken `to_local()` in
#: each forward, as shardlang does.
SIDES = ("shardlang", "hand", "hand_dtensor")


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dry-run", action="store_true", help="CPU workers (gloo) and a tiny model")
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="EP 2 x FSDP: the experts borrow the data-parallel ranks (torchtitan's layout), each rank its own data",
    )
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="after the timing, profile N steps of each side"
    )
    parser.add_argument(
        "--phases",
        type=int,
        default=0,
        metavar="N",
        help="after the timing, N more steps of each side (alternating), forward+backward and the optimizer's "
        "step timed apart (each to the GPUs' synchronisation): where a difference in step time comes from",
    )
    parser.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="after the timing, N steps of each side under cProfile: rank 0 prints each side's top host functions",
    )
    parser.add_argument(
        "--host-ops",
        type=int,
        default=0,
        metavar="N",
        help="after the timing, N steps of each side under torch.profiler (CPU only, every thread: the "
        "autograd engine's device thread too): rank 0 prints each thread's host time and the ops where "
        "shardlang spends the most more than hand",
    )
    return parser.parse_args(argv)


def host_profile(sides, step, steps: int) -> None:
    """Each side's `steps` steps under cProfile; its 25 functions of most own time (ms per step)."""
    import cProfile
    import pstats

    for side in sides:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            step(side)
        profiler.disable()
        stats = pstats.Stats(profiler)
        rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:25]
        total = sum(v[2] for v in stats.stats.values())
        print(f"host profile of {side}: {total / steps * 1e3:.1f} ms of own time per step; the top functions:")
        for (filename, line, name), (_, calls, own, cumulative, _) in rows:
            where = f"{Path(filename).name}:{line}({name})"
            print(
                f"  {own / steps * 1e3:8.2f} ms {cumulative / steps * 1e3:8.2f} ms cum {calls // steps:6d} calls  {where}"
            )


def host_ops(sides, step, steps: int, rank: int) -> None:
    """Each side's `steps` steps under torch.profiler (CPU activity, which records every thread's ops):
    per thread, its ops' own host time per step; per op, own time and calls per step; rank 0 prints the
    threads and the 25 ops of largest difference against `hand` (the profiler's own cost inflates each op
    alike, so a difference in calls shows too)."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    seen = {}
    for side in sides:
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step(side)
        threads, ops = defaultdict(float), defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            # a tensor subclass's dispatch ("PythonSubclass") is named by the op it dispatches
            name = event.name
            if name == "PythonSubclass" and event.cpu_children:
                name = f"PythonSubclass({event.cpu_children[0].name})"
            threads[event.thread] += event.self_cpu_time_total / 1e3 / steps
            ops[name][0] += event.self_cpu_time_total / 1e3 / steps
            ops[name][1] += 1
        seen[side] = (threads, ops)
    if rank:
        return
    for side, (threads, _) in seen.items():
        named = ", ".join(f"thread {t}: {ms:.1f} ms" for t, ms in sorted(threads.items(), key=lambda i: -i[1])[:4])
        print(f"host ops of {side}: {sum(threads.values()):.1f} ms per step; {named}")
    base = seen["hand"][1]
    for side in (s for s in sides if s != "hand"):
        ops = seen[side][1]
        names = set(ops) | set(base)
        diff = sorted(names, key=lambda n: -abs(ops.get(n, (0, 0))[0] - base.get(n, (0, 0))[0]))[:25]
        print(f"{side} - hand, per step: own ms, calls (the 25 largest differences)")
        for name in diff:
            (ms, calls), (base_ms, base_calls) = ops.get(name, (0.0, 0)), base.get(name, (0.0, 0))
            print(f"  {ms - base_ms:+8.2f} ms {(calls - base_calls) / steps:+8.1f} calls  {ms:8.2f} ms  {name[:90]}")


def configure(tiny: bool):
    from transformers import MixtralConfig

    if tiny:
        size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        size.update(num_key_value_heads=2, vocab_size=128)
    else:
        size = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16)
        size.update(num_key_value_heads=8, vocab_size=32000)
    config = MixtralConfig(**size, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    return config


class _Slice:
    """This rank's contiguous 1/n of the rows every rank holds alike; the backward gathers the slices'
    gradients (rows divisible by n)."""

    @staticmethod
    def make():
        import torch
        import torch.distributed as dist

        class Slice(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, group):
                ctx.group = group
                n, r = dist.get_world_size(group), dist.get_rank(group)
                return x.chunk(n)[r].contiguous()

            @staticmethod
            def backward(ctx, grad):
                n = dist.get_world_size(ctx.group)
                whole = grad.new_empty((grad.shape[0] * n, *grad.shape[1:]))
                dist.all_gather_into_tensor(whole, grad.contiguous(), group=ctx.group)
                return whole, None

        class Gather(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, group):
                ctx.group = group
                n = dist.get_world_size(group)
                whole = x.new_empty((x.shape[0] * n, *x.shape[1:]))
                dist.all_gather_into_tensor(whole, x.contiguous(), group=group)
                return whole

            @staticmethod
            def backward(ctx, grad):  # every rank's loss is the same: its gradient is whole on each
                n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
                return grad.chunk(n)[r].contiguous(), None

        return Slice, Gather


def hand_written_ep(model, dtensor: bool = False, group=None) -> None:
    """Expert parallelism by hand over `group` (default: every rank, which share their batch, each routing
    its slice of it): each experts module keeps its rank's experts as plain parameters (or, `dtensor`, as
    Shard(0) DTensors over a 1-D mesh of every rank) and runs this forward. Over a `group` of ranks that
    train on their own data (`--fsdp`), each routes all of its own tokens."""
    import functools
    import types

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    Slice, Gather = _Slice.make()
    shared = group is None
    group = group or dist.group.WORLD
    n, r = dist.get_world_size(group), dist.get_rank(group)
    mesh = init_device_mesh(next(model.parameters()).device.type, (n,)) if dtensor else None

    def routed(self, hidden, index, weights, local_forward, per):
        if shared:
            hidden, index, weights = (Slice.apply(t, None) for t in (hidden, index, weights))
        tokens, k = index.shape
        chosen = index.reshape(-1)
        # the pairs by expert, so by the rank holding it; each expert's count, and what each rank receives
        order = torch.argsort(chosen, stable=True)
        token_of = torch.arange(tokens, device=chosen.device).repeat_interleave(k)[order]
        send = torch.bincount(chosen, minlength=n * per)
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=group)
        send_sizes, receive_sizes = send.view(n, per).sum(1).tolist(), receive.view(n, per).sum(1).tolist()
        rows = wait_tensor(all_to_all_single_autograd(hidden[token_of], receive_sizes, send_sizes, group))
        # each received row's local expert: the rows of each rank arrive by expert
        received = torch.arange(per, device=rows.device).repeat(n).repeat_interleave(receive, output_size=rows.shape[0])
        ones = torch.ones(received.shape[0], 1, dtype=weights.dtype, device=rows.device)
        out = local_forward(rows, received[:, None], ones)
        back = wait_tensor(all_to_all_single_autograd(out, send_sizes, receive_sizes, group))
        weighted = back * weights.reshape(-1)[order, None].to(back.dtype)
        combined = torch.zeros_like(hidden, dtype=back.dtype).index_add(0, token_of, weighted)
        combined = combined.to(hidden.dtype)
        return Gather.apply(combined, None) if shared else combined

    def local_views(self, hidden, index, weights, local_forward, per):
        shared = {k: p for k, p in self._parameters.items() if isinstance(p, DTensor)}
        self._parameters.update({k: p.to_local() for k, p in shared.items()})
        try:
            return routed(self, hidden, index, weights, local_forward, per)
        finally:
            self._parameters.update(shared)

    for layer in model.model.layers:
        experts = layer.mlp.experts
        per = experts.num_experts // n
        for name in ("gate_up_proj", "down_proj"):
            mine = getattr(experts, name).detach()[r * per : (r + 1) * per].clone()
            if dtensor:
                mine = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(mine))
        experts.num_experts = per
        run = functools.partial(local_views if dtensor else routed, local_forward=experts.forward, per=per)
        experts.forward = types.MethodType(lambda self, h, i, w, run=run: run(self, h, i, w), experts)


def hand_written_ep_fsdp(model, ep: int, cuda: bool) -> None:
    """torchtitan's layout by hand: a (dp, ep) mesh, each experts module split over ep (each rank routing
    its own tokens, `hand_written_ep`) in an FSDP2 unit of its own over dp, with its gradients divided by
    dp x ep (every rank trains on its own data); everything else FSDP2 over dp x ep flattened. bf16
    compute, fp32 reduction, as the plan says."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))
    flat = mesh["dp", "ep"]._flatten("dp_ep")
    hand_written_ep(model, group=mesh["ep"].get_group())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        experts = fully_shard(layer.mlp.experts, mesh=mesh["dp"], mp_policy=policy)
        if cuda:  # gloo (the dry run) has no PreMulSum to divide by another factor
            experts.set_gradient_divide_factor(float(world))
        fully_shard(layer, mesh=flat, mp_policy=policy)
    fully_shard(model, mesh=flat, mp_policy=policy)


def main(argv=None) -> None:
    args = arguments(argv)
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    from transformers import MixtralForCausalLM

    import shardlang
    from benchmarks.gpu_throughput import NoMemory, alternate, join, print_profiles, profile, timed_step
    from shardlang.runtime.apply import apply_plan
    from shardlang.verification.comms import Recorder

    cuda = not args.dry_run
    device = join(args.dry_run)
    memory = torch.cuda if cuda else NoMemory()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = configure(args.dry_run)
    seq = 32 if args.dry_run else args.seq
    name = "mixtral_ep_fsdp.sl" if args.fsdp else "mixtral_ep.sl"
    plan = shardlang.load(ROOT / "benchmarks" / "plans" / name, world_size=world)
    sides = ("shardlang", "hand") if args.fsdp else SIDES  # under FSDP every parameter is a DTensor

    def build():
        torch.manual_seed(0)
        with device:
            return MixtralForCausalLM(config).to(torch.bfloat16)

    def build_shardlang():
        return apply_plan(plan, build()).model

    def build_hand(dtensor: bool):
        model = build()
        hand_written_ep(model, dtensor)
        return model

    if args.fsdp:
        hand = build()
        hand_written_ep_fsdp(hand, 2, cuda)
        built = {"shardlang": build_shardlang(), "hand": hand}
    else:
        built = {"shardlang": build_shardlang(), "hand": build_hand(False), "hand_dtensor": build_hand(True)}

    def groups(model):
        # fused AdamW takes no mix of DTensors (the experts on shardlang's side) and plain tensors in one group
        from torch.distributed.tensor import DTensor

        params = list(model.parameters())
        split = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
        return [{"params": group} for group in split if group]

    optims = {side: torch.optim.AdamW(groups(m), lr=1e-4, fused=cuda) for side, m in built.items()}
    # the same tokens on every rank (EP alone: the ranks share their batch), or each rank its own (--fsdp)
    seed = 1 + (rank if args.fsdp else 0)
    tokens = torch.randint(0, config.vocab_size, (args.batch, seq), generator=torch.Generator().manual_seed(seed))
    tokens = tokens.to(device)

    def forward_backward(model):
        logits = model(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        return loss.item()

    # the same model on both sides: their first losses agree (bf16: to about a percent)
    first = {side: forward_backward(built[side]) for side in sides}
    for side in sides:
        optims[side].zero_grad(set_to_none=True)

    def step(side) -> None:
        forward_backward(built[side])
        optims[side].step()
        optims[side].zero_grad(set_to_none=True)

    def timed(side) -> tuple[float, int]:
        return timed_step(memory, lambda: step(side))

    for _ in range(args.warmup):
        for side in sides:
            timed(side)
    counts = {}
    for side in sides:
        recorder = Recorder()
        with recorder:
            forward_backward(built[side])
        optims[side].zero_grad(set_to_none=True)
        counts[side] = recorder.counts()
    times, peaks = alternate(sides, args.steps, timed)

    def phases(side) -> tuple[float, int]:
        forward_backward_s, _ = timed_step(memory, lambda: forward_backward(built[side]))
        optimizer_s, _ = timed_step(memory, lambda: (optims[side].step(), optims[side].zero_grad(set_to_none=True)))
        return (forward_backward_s, optimizer_s), 0

    split = alternate(sides, args.phases, phases)[0] if args.phases else {}
    if args.host_profile and rank == 0:
        host_profile(sides, step, args.host_profile)
    elif args.host_profile:
        for side in sides:
            for _ in range(args.host_profile):
                step(side)
    if args.host_ops:
        host_ops(sides, step, args.host_ops, rank)
    profiles = {side: profile(lambda side=side: timed(side), args.profile) for side in sides} if args.profile else {}
    everyone = [None] * world
    dist.all_gather_object(everyone, (times, peaks, counts, split))
    if rank == 0:
        slowest = {s: [max(t[0][s][i] for t in everyone) for i in range(args.steps)] for s in sides}
        result = {
            "card": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "world": world,
            "parameters": sum(p.numel() for p in build().parameters()) if not cuda else _count(config),
            "tokens_per_step": args.batch * seq,
            "first_loss": first,
            "steps": args.steps,
            "layout": "ep 2 x fsdp (experts borrowing dp)" if args.fsdp else "ep over every rank",
        }
        for side in sides:
            median = statistics.median(slowest[side])
            result[side] = {
                "median_s": median,
                "tokens_per_s": args.batch * seq / median,
                "peak_bytes": max(t[1][side] for t in everyone),
                "counts": everyone[0][2][side],
            }
        result["ratio"] = result["hand"]["median_s"] / result["shardlang"]["median_s"]  # > 1: shardlang faster
        if "hand_dtensor" in result:
            result["ratio_dtensor"] = result["hand_dtensor"]["median_s"] / result["shardlang"]["median_s"]
        if args.phases:
            for side in sides:  # each phase: the slowest rank's, the median over the steps
                for k, phase in enumerate(("forward_backward_s", "optimizer_s")):
                    slow = [max(t[3][side][i][k] for t in everyone) for i in range(args.phases)]
                    result[side][phase] = statistics.median(slow)
        result["memory_ratio"] = result["shardlang"]["peak_bytes"] / max(1, result["hand"]["peak_bytes"])
        print("RESULT " + json.dumps(result), flush=True)
        report(result)
        print_profiles(profiles)
    # gloo's threads at interpreter exit can abort the process ("terminate called without an active
    # exception", torch 2.13): collect what refers to the groups, destroy them, and leave without exit hooks
    import gc

    built.clear()
    optims.clear()
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _count(config) -> int:
    import torch
    from transformers import MixtralForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in MixtralForCausalLM(config).parameters())


def report(result: dict) -> None:
    print(
        f"Mixtral {result['parameters'] / 1e9:.2f}B, {result['layout']}, {result['world']} x {result['card']}, "
        f"torch {result['torch']}"
    )
    print(f"{'side':<13} {'median step':>12} {'tokens/s':>10} {'peak memory':>12}  collectives")
    for side in (s for s in SIDES if s in result):
        r = result[side]
        print(
            f"{side:<13} {r['median_s'] * 1e3:>10.1f} ms {r['tokens_per_s']:>10.0f} "
            f"{r['peak_bytes'] / 2**30:>10.2f} GiB  {r['counts']}"
        )
    if "optimizer_s" in result["shardlang"]:
        for side in (s for s in SIDES if s in result):
            r = result[side]
            print(
                f"{side:<13} phases: forward+backward {r['forward_backward_s'] * 1e3:.1f} ms, "
                f"optimizer step {r['optimizer_s'] * 1e3:.1f} ms"
            )
    dtensor = f"hand_dtensor / shardlang: {result['ratio_dtensor']:.4f}; " if "ratio_dtensor" in result else ""
    print(
        f"hand / shardlang step time: {result['ratio']:.4f}; {dtensor}"
        f"peak memory shardlang / hand: {result['memory_ratio']:.4f}"
    )


if __name__ == "__main__":
    main()
