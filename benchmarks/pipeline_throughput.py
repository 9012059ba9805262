"""Pipeline training throughput of the ~1B Llama-style model: shardlang's pipelined plan against the same
schedule written by hand with torch.distributed.pipelining, in one run, alternating the two after warm-up;
plus peak memory and the sends and receives of a step.

    torchrun --nproc-per-node 2 benchmarks/pipeline_throughput.py [--schedule 1f1b] [--steps 30]
    torchrun --nproc-per-node 4 benchmarks/pipeline_throughput.py        # pp 2 x dp 2
    ... [--both-orders | --hand-first] [--profile]

Whichever version is built second in the process has run 1-3% faster (RESULTS.md): `--both-orders`
measures with each built first in turn and reports each order's ratio and the ratio over both.

The plan is benchmarks/plans/llama_1b_pp.sl (pp 2, FSDP2 over the rest in each stage, bf16 compute with
fp32 reduction, built on meta). The hand-written version is what a user writes without shardlang: a stage
module holding its blocks (torchtitan's contract), fully_shard on each block and the stage, to_empty and
reset_parameters, PipelineStage and the schedule class. Fused AdamW; batch 8 x 2048 per data-parallel rank in
8 microbatches. Rank 0 prints one table. `--dry-run` checks the script on CPU workers with the tiny model.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import shardlang  # noqa: E402
from benchmarks import llama_1b  # noqa: E402
from benchmarks.gpu_throughput import join  # noqa: E402
from shardlang.frontend.ir import SCHEDULES  # noqa: E402
from shardlang.runtime.apply import apply_plan, build_pipeline  # noqa: E402


class HandStage(nn.Module):
    """One pipeline stage of examples/llama.py's Transformer as a user writes it by hand: the blocks of its
    range, the embedding on the first stage, the norm and output layer on the last."""

    def __init__(self, model, blocks: range, first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in blocks})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope", model.rope, persistent=False)

    def forward(self, x):
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self.output(self.norm(h)) if self.output is not None else h


def handwritten(pp_mesh, dp_mesh, stage_ids, num_stages, schedule, microbatches, device, loss):
    import torch.distributed.pipelining as pipelining
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.pipelining import PipelineStage

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    stages, parts = [], []
    per = llama_1b.LAYERS // num_stages
    for s in stage_ids:
        with torch.device("meta"):
            whole = llama_1b.build_model()
        part = HandStage(whole, range(s * per, (s + 1) * per), s == 0, s == num_stages - 1)
        for block in part.layers.values():
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        fully_shard(part, mesh=dp_mesh, mp_policy=policy)
        part.to_empty(device=device)
        with torch.no_grad():
            for module in part.modules():
                if callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()
        part.rope = _rope(device)  # a buffer the constructor computed: to_empty left it garbage
        parts.append(part)
        stages.append(PipelineStage(part, s, num_stages, device, group=pp_mesh.get_group()))
    kind = getattr(pipelining, SCHEDULES[schedule][0])
    return parts, kind(stages[0] if len(stages) == 1 else stages, microbatches, loss_fn=loss)


def _rope(device):
    from examples.llama import rotary_table

    return rotary_table(llama_1b.DIM // llama_1b.HEADS, llama_1b.SEQ).to(device)


def profiled(step, cuda: bool) -> dict:
    """One step under torch's profiler: the host's ops and, on GPUs, the kernels, by name: {name: [count, us]}."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    kernels, ops = {}, {}
    for event in prof.events():
        table = kernels if event.device_type == DeviceType.CUDA else ops
        count, us = table.get(event.name, (0, 0.0))
        table[event.name] = (count + 1, us + event.time_range.elapsed_us())
    return {"kernels": kernels, "ops": ops}


def print_profiles(gathered: list) -> None:
    """Per rank: kernels and host ops in all, then the names whose count or time differs most."""
    for rank, profiles in enumerate(gathered):
        print(f"rank {rank}:")
        for kind in ("kernels", "ops"):
            ours, theirs = profiles["shardlang"][kind], profiles["hand-written"][kind]
            total = {
                name: (sum(c for c, _ in t.values()), sum(u for _, u in t.values()))
                for name, t in (("ours", ours), ("theirs", theirs))
            }
            print(
                f"  {kind}: shardlang {total['ours'][0]} ({total['ours'][1] / 1000:.1f} ms), "
                f"hand-written {total['theirs'][0]} ({total['theirs'][1] / 1000:.1f} ms)"
            )
            names = set(ours) | set(theirs)
            differ = sorted(names, key=lambda n: -abs(ours.get(n, (0, 0.0))[1] - theirs.get(n, (0, 0.0))[1]))
            for name in differ[:8]:
                (c1, u1), (c2, u2) = ours.get(name, (0, 0.0)), theirs.get(name, (0, 0.0))
                print(f"    {name[:70]:70} {c1:>6} {u1 / 1000:>8.2f} ms | {c2:>6} {u2 / 1000:>8.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved_1f1b"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--dry-run", action="store_true", help="the tiny model on CPU workers (gloo)")
    parser.add_argument(
        "--hand-first", action="store_true", help="build the hand-written version first, on meshes of its own"
    )
    parser.add_argument(
        "--both-orders", action="store_true", help="measure with each version built first in turn, then together"
    )
    parser.add_argument("--profile", action="store_true", help="then profile one step of each; print where they differ")
    args = parser.parse_args()
    global llama_1b
    if args.dry_run:
        import examples.llama as tiny

        class Tiny:
            VOCAB, DIM, HEADS, LAYERS, SEQ = tiny.VOCAB, tiny.DIM, tiny.HEADS, 4, tiny.SEQ
            loss, example_input = staticmethod(tiny.loss), staticmethod(tiny.example_input)

            @staticmethod
            def build_model():
                return tiny.Transformer(layers=4)

        llama_1b = Tiny
    cuda = not args.dry_run
    device = join(args.dry_run)
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = 2 if args.schedule == "interleaved_1f1b" else 1
    params = {"schedule": args.schedule, "per_rank": per_rank, "microbatches": args.microbatches}
    plan = shardlang.load(ROOT / "benchmarks" / "plans" / "llama_1b_pp.sl", params, world_size=world)

    num_stages = 2 * per_rank
    stage_ids = plan.pipeline.stage_ranks(2)

    def build_theirs(mesh):
        mine = [s for s, r in enumerate(stage_ids) if r == mesh["pp"].get_local_rank()]
        parts, schedule = handwritten(
            mesh["pp"], mesh["dp"], mine, num_stages, args.schedule, args.microbatches, device, llama_1b.loss
        )
        return parts, schedule, torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=1e-4, fused=cuda)

    def phase(hand_first: bool, profile: bool) -> tuple[dict, dict, dict, int]:
        """Both versions built (the hand-written one first, on meshes of its own, with `hand_first`), warmed up
        and timed alternately; this rank's step times, host times and peaks, and shardlang's parameter
        memory. Both models are garbage once it returns."""
        if hand_first:
            from torch.distributed.device_mesh import init_device_mesh

            own = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("pp", "dp"))
            parts, theirs, optim_theirs = build_theirs(own)
        torch.manual_seed(0)
        base = torch.cuda.memory_allocated() if cuda else 0
        applied = apply_plan(plan, plan.build(llama_1b.build_model))
        mesh = applied.meshes["world"]
        pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        tokens = llama_1b.example_input(args.batch, torch.Generator().manual_seed(dp_rank)).to(device)
        ours = build_pipeline(applied, llama_1b.loss)
        optim_ours = torch.optim.AdamW(applied.model.parameters(), lr=1e-4, fused=cuda)
        params_ours = (torch.cuda.memory_allocated() if cuda else 0) - base
        if not hand_first:
            parts, theirs, optim_theirs = build_theirs(mesh)

        def step_ours():
            ours.step(tokens)
            optim_ours.step()
            optim_ours.zero_grad(set_to_none=True)

        def step_theirs():
            if pp_rank == 0:
                theirs.step(tokens, target=tokens)
            else:
                theirs.step(target=tokens)
            optim_theirs.step()
            optim_theirs.zero_grad(set_to_none=True)

        for _ in range(args.warmup):
            timed(step_ours)
            timed(step_theirs)
        times = {"shardlang": [], "hand-written": []}
        host = {"shardlang": [], "hand-written": []}
        peaks = {"shardlang": 0, "hand-written": 0}
        for i in range(args.steps):
            order = [("shardlang", step_ours), ("hand-written", step_theirs)]
            for name, step in order if i % 2 == 0 else order[::-1]:
                elapsed, queued, peak = timed(step)
                times[name].append(elapsed)
                host[name].append(queued)
                peaks[name] = max(peaks[name], peak)
        if profile:
            profiles = {
                name: profiled(step, cuda) for name, step in (("shardlang", step_ours), ("hand-written", step_theirs))
            }
            gathered = [None] * world
            dist.all_gather_object(gathered, profiles)
            if rank == 0:
                print_profiles(gathered)
        return times, host, peaks, params_ours

    def timed(step) -> tuple[float, float, int]:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        dist.barrier()
        start = time.perf_counter()
        step()
        queued = time.perf_counter() - start  # the host's part: until the last kernel is queued
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated() - before) if cuda else 0
        return elapsed, queued, peak

    # The version built second has run 1-3% faster (RESULTS.md): --both-orders measures each order in turn.
    orders = [False, True] if args.both_orders else [args.hand_first]
    times = {"shardlang": [], "hand-written": []}
    host = {"shardlang": [], "hand-written": []}
    peaks = {"shardlang": 0, "hand-written": 0}
    per_order = []
    for n, hand_first in enumerate(orders):
        t, h, k, params_ours = phase(hand_first, args.profile and n == 0)
        gc.collect()  # the phase's models (their hooks make cycles) and their memory
        if cuda:
            torch.cuda.empty_cache()
        per_order.append((hand_first, t))
        for name in times:
            times[name] += t[name]
            host[name] += h[name]
            peaks[name] = max(peaks[name], k[name])
    # The slowest rank sets the step time: take each step's maximum over the ranks.
    everyone = [None] * world
    dist.all_gather_object(everyone, (times, peaks, host, per_order))
    count = len(times["shardlang"])
    steps = {name: [max(e[0][name][i] for e in everyone) for i in range(count)] for name in times}
    result = {
        "schedule": args.schedule,
        "world": world,
        "card": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "steps": args.steps,
        "microbatches": args.microbatches,
        "params_mem_ours": params_ours,
        "orders": ["hand-written first" if h else "shardlang first" for h in orders],
        "peak": {name: max(e[1][name] for e in everyone) for name in times},
        "host_median_s": {name: statistics.median(host[name]) for name in host},
    }
    dp = world // 2
    for name in steps:
        median = statistics.median(steps[name])
        result[name] = {"median_s": median, "tokens_per_s": args.batch * llama_1b.SEQ * dp / median}
    if rank == 0:
        ratio = result["shardlang"]["tokens_per_s"] / result["hand-written"]["tokens_per_s"]
        print(
            f"pp 2 x dp {dp}, {args.schedule}, {args.microbatches} microbatches, on {world} x {result['card']}, torch {result['torch']}"
        )
        print(f"{'':16}{'step (s)':>10}{'tokens/s':>12}{'step peak (GiB)':>17}{'host (s)':>10}")
        for name in ("shardlang", "hand-written"):
            row = result[name]
            print(
                f"{name:16}{row['median_s']:>10.4f}{row['tokens_per_s']:>12.0f}"
                f"{result['peak'][name] / 2**30:>17.2f}{result['host_median_s'][name]:>10.4f}"
            )
        print(f"throughput ratio shardlang / hand-written: {ratio:.4f}")
        if len(orders) > 1:
            for n, hand_first in enumerate(orders):
                ratio_n = [
                    statistics.median([max(e[3][n][1][name][i] for e in everyone) for i in range(args.steps)])
                    for name in ("hand-written", "shardlang")
                ]
                first = "hand-written" if hand_first else "shardlang"
                print(f"  built {first} first: ratio {ratio_n[0] / ratio_n[1]:.4f}")
        print("per rank, median step / median host time until the step's last kernel is queued (ms):")
        for r, (t, _, h, _) in enumerate(everyone):
            cells = [f"{n} {statistics.median(t[n]) * 1e3:.1f} / {statistics.median(h[n]) * 1e3:.1f}" for n in t]
            print(f"  rank {r}: " + ", ".join(cells))
        print("RESULT " + json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
