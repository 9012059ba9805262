"""shardlang's `context_parallel` against torch's `context_parallel` written by hand, on the ~1B Llama of the
benchmarks (benchmarks/llama_1b.py) at a long sequence, CP over every GPU, FSDP2 over the same ranks:
both built in one run and trained alternately after warm-up; median step time, tokens/s, peak memory.

    torchrun --nproc-per-node 2 benchmarks/cp_compare.py --seq 32768     # GPUs only: torch's CP is CUDA's

shardlang's side: benchmarks/plans/llama_1b_cp.sl, the model given each whole sequence; its hooks split it
(head-tail), its attention gathers keys and values over cp (each chunk of queries through torch's
causal_lower_right: flash), its output stays local (`output = local`) and the loss is taken on the rank's
shard of the logits against `plan.context_shard(model, labels)`, as on torch's side. The hand-written
side: torch.distributed.tensor.experimental.context_parallel over the same mesh dim with the tokens, the
shifted labels and the rotary table as its buffers (head-tail, torch's default load balancer), its ring
attention on CUDA's flash kernel, the loss taken on each rank's shard of the logits and labels
(torchtitan's way; FSDP averages the cp ranks' gradients). bf16 compute, fp32 reduction, fused AdamW on
both. What differs is what is measured: the attention (keys and values gathered whole and kept for the
backward, against the ring's chunks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("shardlang", "torch")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="after the timing, profile N steps of each side"
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.experimental import context_parallel

    import shardlang
    from benchmarks import llama_1b
    from benchmarks.gpu_throughput import alternate, join, print_profiles, profile, timed_step
    from shardlang.runtime.apply import apply_plan

    device = join(False)
    rank, world = dist.get_rank(), dist.get_world_size()

    def build():
        torch.manual_seed(0)
        with device:
            return llama_1b.build_model(args.seq)

    plan = shardlang.load(ROOT / "benchmarks" / "plans" / "llama_1b_cp.sl", world_size=world)
    ours = apply_plan(plan, build()).model
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
    hand = build()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in hand.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(hand, mesh=mesh, mp_policy=policy)
    models = {"shardlang": ours, "torch": hand}
    optims = {side: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for side, m in models.items()}
    tokens = torch.randint(0, llama_1b.VOCAB, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(device)
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)

    def step(side):
        if side == "shardlang":
            # `output = local`: this rank's shard of the logits, against its shard of the shifted labels
            logits = ours(tokens)
            mine = plan.context_shard(ours, labels)
            loss = F.cross_entropy(logits.float().flatten(0, 1), mine.flatten(), ignore_index=-100)
            loss.backward()
        else:
            # torch shards its buffers in place for the length of the context: fresh copies each step
            t, y, rope = tokens.clone(), labels.clone(), hand.rope
            with context_parallel(mesh, buffers=[t, y, rope], buffer_seq_dims=[1, 1, 0], no_restore_buffers={t, y}):
                logits = hand(t)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
                loss.backward()
        optims[side].step()
        optims[side].zero_grad(set_to_none=True)

    def timed(side):
        return timed_step(torch.cuda, lambda: step(side))

    for _ in range(args.warmup):
        for side in SIDES:
            timed(side)
    times, peaks = alternate(SIDES, args.steps, timed)

    # The peak of a step with the side's own parameters and optimizer states, as `shardlang explain`
    # predicts it: what the GPU held at its peak less what the other side keeps resident meanwhile.
    def resident(side):
        tensors = [getattr(p, "_local_tensor", p) for p in models[side].parameters()]
        tensors += [t for state in optims[side].state.values() for t in state.values() if torch.is_tensor(t)]
        return sum(getattr(t, "_local_tensor", t).untyped_storage().nbytes() for t in tensors)

    absolute = {}
    for side, other in zip(SIDES, SIDES[::-1]):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        timed(side)
        absolute[side] = torch.cuda.max_memory_allocated() - resident(other)
    profiles = {side: profile(lambda side=side: timed(side), args.profile) for side in SIDES} if args.profile else {}
    everyone = [None] * world
    dist.all_gather_object(everyone, (times, peaks, absolute))
    if rank == 0:
        result = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "world": world, "seq": args.seq}
        for side in SIDES:
            median = statistics.median(max(e[0][side][i] for e in everyone) for i in range(args.steps))
            result[side] = {
                "median_s": median,
                "tokens_per_s": args.seq / median,
                "peak_bytes": max(e[1][side] for e in everyone),
                "absolute_peak_bytes": max(e[2][side] for e in everyone),
            }
        result["ratio"] = result["torch"]["median_s"] / result["shardlang"]["median_s"]
        result["memory_ratio"] = result["shardlang"]["peak_bytes"] / result["torch"]["peak_bytes"]
        print(f"{'side':<10} {'median step':>12} {'tokens/s':>10} {'peak memory':>12} {'peak, own states':>17}")
        for side in SIDES:
            r = result[side]
            print(
                f"{side:<10} {r['median_s'] * 1e3:>10.1f} ms {r['tokens_per_s']:>10.0f} {r['peak_bytes'] / 2**30:>10.2f} GiB"
                f" {r['absolute_peak_bytes'] / 2**30:>13.2f} GiB"
            )
        print(f"throughput shardlang / torch: {result['ratio']:.4f}; peak memory: {result['memory_ratio']:.4f}")
        print_profiles(profiles)
        print("RESULT " + json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
