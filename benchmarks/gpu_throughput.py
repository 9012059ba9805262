"""Training throughput of the ~1B Llama-style model: shardlang's plan against the same calls written by
hand, in one run, alternating the two after warm-up; plus peak memory, collective counts, MFU, and the
memory explain predicted against what the GPUs allocated.

    torchrun --nproc-per-node 4 benchmarks/gpu_throughput.py --config fsdp|tp_fsdp [--steps 10]

Both versions build on the meta device and materialise on the GPUs; bf16 compute with fp32 reduction,
fused AdamW, batch 4 per data-parallel rank, sequence 2048. Rank 0 prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import shardlang  # noqa: E402
from benchmarks import llama_1b  # noqa: E402
from shardlang.runtime.apply import apply_plan  # noqa: E402
from shardlang.verification.comms import Recorder  # noqa: E402

#: bf16 dense peak of the cards the device tool lends (H100 SXM and H200: 989.4 TFLOP/s).
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}


class NoMemory:
    """torch.cuda's memory and sync calls, for a dry run on the CPU."""

    def synchronize(self):
        pass

    def memory_allocated(self):
        return 0

    def max_memory_allocated(self):
        return 0

    def reset_peak_memory_stats(self):
        pass


def join(dry_run: bool) -> torch.device:
    """This torchrun process's process group, nccl on its own GPU (gloo on the CPU for a dry run), and the
    device it computes on."""
    if dry_run:
        dist.init_process_group("gloo")
        return torch.device("cpu")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    return torch.device("cuda", torch.cuda.current_device())


def timed_step(memory, step) -> tuple[float, int]:
    """`step()` timed from a barrier to the GPU's synchronisation, and the most memory it allocated above
    what was allocated before it (`memory`: torch.cuda, or NoMemory for a dry run)."""
    memory.synchronize()
    memory.reset_peak_memory_stats()
    before = memory.memory_allocated()
    dist.barrier()
    start = time.perf_counter()
    step()
    memory.synchronize()
    return time.perf_counter() - start, memory.max_memory_allocated() - before


def alternate(sides: tuple[str, ...], steps: int, timed) -> tuple[dict[str, list[float]], dict[str, int]]:
    """`steps` timed steps of each side, alternating (even steps in the order of `sides`, odd ones reversed):
    each side's step times, and its largest peak. `timed(side)` runs one step: (seconds, peak bytes)."""
    times: dict[str, list[float]] = {side: [] for side in sides}
    peaks = dict.fromkeys(sides, 0)
    for i in range(steps):
        for side in sides if i % 2 == 0 else sides[::-1]:
            elapsed, peak = timed(side)
            times[side].append(elapsed)
            peaks[side] = max(peaks[side], peak)
    return times, peaks


#: Kernel kinds for --profile, by the first pattern a kernel's name matches (lower case).
KERNEL_KINDS = (
    ("nccl", r"nccl"),
    ("attention", r"flash|fmha|cudnn|attention|sdpa"),
    ("matmul", r"gemm|cutlass|nvjet|sm90_|sm80_|cublas|xmma"),
    ("optimizer", r"adam|multi_tensor"),
    ("fused (triton)", r"^triton_"),
    ("cross-entropy", r"softmax|nll|log_softmax|cross_entropy"),
    ("copy / cast", r"copy|cast|convert|cat|fill|memset"),
    ("other", r""),
)


def profile(step, steps: int) -> dict:
    """`steps` steps under torch.profiler: the GPU time per step by kernel kind, and the 12 longest
    kernels (ms per step). NCCL kernels run beside the compute: their time overlaps the rest; the GPU's
    busy time is the rest's sum, against the step's wall time (a step much longer is bound by the host)."""
    import re

    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    # Every rank steps (the collectives need them all); on the CPU (a dry run) no kernel has a GPU time.
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
    start = time.perf_counter()
    with torch_profile(activities=[activity]) as prof:
        for _ in range(steps):
            step()
    wall = (time.perf_counter() - start) * 1e3 / steps
    kinds: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if not us or event.key.startswith(("ProfilerStep", "cudaDeviceSynchronize")):
            continue
        name = event.key.lower()
        kind = next(k for k, pattern in KERNEL_KINDS if re.search(pattern, name))
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e3 / steps
        kernels[event.key[:90]] = us / 1e3 / steps
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    busy = sum(ms for kind, ms in kinds.items() if kind != "nccl")
    return {
        "by_kind_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "top_ms": top,
        "busy_ms": busy,
        "wall_ms": wall,
    }


#: Where an allocation is made, for memory_at_peak: the first Python frame in these, else the first C++ frame
#: naming an op or a backward node.
OWN_CODE = ("shardlang/", "torchtitan/", "benchmarks/", "examples/", "transformers/")
CPP_NAMES = ("torch::autograd::generated::", "at::native::", "c10d::", "at::_ops::")


def memory_at_peak(step, top: int = 14) -> dict:
    """One `step()` under torch.cuda's memory history: the bytes allocated during it and still live at its
    peak, grouped by where each was allocated (see OWN_CODE), the `top` largest groups (MiB) and the peak
    above what was allocated before the step. On the CPU (a dry run), empty."""
    import torch

    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="all")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][torch.cuda.current_device()]
    live, total, peak, at_peak = {}, 0, 0, {}
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _allocated_at(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    groups: dict[str, int] = {}
    for size, where in at_peak.values():
        groups[where] = groups.get(where, 0) + size
    ranked = sorted(groups.items(), key=lambda item: -item[1])[:top]
    return {"peak_mib": peak / 2**20, "top_mib": [(where, size / 2**20) for where, size in ranked]}


def _allocated_at(frames) -> str:
    for frame in frames:
        name = frame.get("filename", "")
        if name.endswith(".py") and any(part in name for part in OWN_CODE):
            short = name[max(name.rfind(part) for part in OWN_CODE if part in name) :]
            return f"{short}:{frame.get('line')} ({frame.get('name')})"
    for frame in frames:
        if any(part in frame.get("name", "") for part in CPP_NAMES):
            return frame["name"][:90]
    return "(elsewhere)"


def print_memory(seen: dict) -> None:
    """--memory's tables, one per side."""
    for side, found in seen.items():
        if not found:
            continue
        print(f"{side}: {found['peak_mib']:.0f} MiB allocated during the step live at its peak; the largest by origin:")
        for where, mib in found["top_mib"]:
            print(f"  {mib:>9.1f} MiB  {where}")


def print_profiles(profiles: dict) -> None:
    """--profile's tables, one per side."""
    for side, seen in profiles.items():
        print(
            f"{side}: GPU ms per step by kernel kind (NCCL overlaps the rest); GPU busy {seen['busy_ms']:.1f} ms "
            f"of a {seen['wall_ms']:.1f} ms step (profiled)"
        )
        for kind, ms in seen["by_kind_ms"].items():
            print(f"  {kind:16}{ms:>9.2f}")
        for name, ms in seen["top_ms"]:
            print(f"    {ms:>8.2f}  {name}")


class Tiny:
    """The tiny example model in llama_1b's place, for a dry run."""

    def __init__(self, module):
        self.build_model, self.example_input, self.loss, self.SEQ = (
            module.build_model,
            module.example_input,
            module.loss,
            module.SEQ,
        )

    def flops_per_token(self):
        return 0.0


def handwritten(model: torch.nn.Module, config: str, world: int, device: str):
    """What a user writes by hand for the same plan: torchtitan's order, then to_empty and init."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from benchmarks.handwritten import parallelize_llama

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if config == "fsdp":
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
        dp = mesh["dp"]
    else:
        mesh = init_device_mesh(device, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"], mesh["tp"]
        parallelize_llama(model, tp)
    for block in model.layers:
        fully_shard(block, mesh=dp, mp_policy=policy)
    fully_shard(model, mesh=dp, mp_policy=policy)
    model.to_empty(
        device=torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    )
    with torch.no_grad():
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
    return mesh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=("fsdp", "tp_fsdp"), required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--explain", metavar="JSON", help="explain's prediction for this plan (to compare memory)")
    parser.add_argument(
        "--dry-run", action="store_true", help="check this script on CPU workers (gloo) with the tiny example model"
    )
    args = parser.parse_args()
    global llama_1b
    if args.dry_run:
        import examples.llama as tiny

        llama_1b = Tiny(tiny)
    cuda = not args.dry_run
    join(args.dry_run)
    memory = torch.cuda if cuda else NoMemory()
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = shardlang.load(ROOT / "benchmarks" / "plans" / f"llama_1b_{args.config}.sl")
    tp = 2 if args.config == "tp_fsdp" else 1
    dp_rank = rank // tp
    tokens = llama_1b.example_input(args.batch, torch.Generator().manual_seed(dp_rank))
    tokens = tokens.cuda() if cuda else tokens

    def step(model, optim):
        loss = llama_1b.loss(model(tokens), tokens)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    def timed(model, optim) -> float:
        memory.synchronize()
        start = time.perf_counter()
        step(model, optim)
        memory.synchronize()
        return time.perf_counter() - start

    # shardlang first, alone, to measure what its state occupies, against explain's prediction.
    base = memory.memory_allocated()
    torch.manual_seed(0)
    ours = plan.build(llama_1b.build_model)
    apply_plan(plan, ours)
    params_mem = memory.memory_allocated() - base
    optim_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4, fused=cuda)
    loss = llama_1b.loss(ours(tokens), tokens)
    loss.backward()
    grads_mem = memory.memory_allocated() - base - params_mem
    optim_ours.step()
    optim_ours.zero_grad(set_to_none=True)
    optimizer_mem = memory.memory_allocated() - base - params_mem
    del loss

    with torch.device("meta"):
        theirs = llama_1b.build_model()
    torch.manual_seed(0)
    handwritten(theirs, args.config, world, "cuda" if cuda else "cpu")
    optim_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-4, fused=cuda)
    step(theirs, optim_theirs)

    counts = {}
    for name, model, optim in (("shardlang", ours, optim_ours), ("hand-written", theirs, optim_theirs)):
        recorder = Recorder()
        with recorder:
            loss = llama_1b.loss(model(tokens), tokens)
            loss.backward()
        optim.zero_grad(set_to_none=True)
        counts[name] = recorder.counts()

    for _ in range(args.warmup):
        timed(ours, optim_ours)
        timed(theirs, optim_theirs)
    times = {"shardlang": [], "hand-written": []}
    peaks = {"shardlang": 0, "hand-written": 0}
    for i in range(args.steps):
        order = [("shardlang", ours, optim_ours), ("hand-written", theirs, optim_theirs)]
        for name, model, optim in order if i % 2 == 0 else order[::-1]:
            before = memory.memory_allocated()
            memory.reset_peak_memory_stats()
            times[name].append(timed(model, optim))
            peaks[name] = max(peaks[name], memory.max_memory_allocated() - before)

    result = {
        "config": args.config,
        "world": world,
        "card": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "steps": args.steps,
        "counts": counts,
        "params_mem": params_mem,
        "grads_mem": grads_mem,
        "optimizer_mem": optimizer_mem,
        "transient_peak": peaks,
    }
    tokens_per_step = args.batch * llama_1b.SEQ * (world // tp)
    for name in times:
        median = statistics.median(times[name])
        result[name] = {"median_s": median, "tokens_per_s": tokens_per_step / median}
    if rank == 0:
        report(result, args)
    dist.destroy_process_group()


def report(result: dict, args) -> None:
    card = next((k for k in PEAK_BF16 if k in result["card"]), None)
    flops = llama_1b.flops_per_token()
    ours, theirs = result["shardlang"], result["hand-written"]
    print(
        f"{result['config']} on {result['world']} x {result['card']}, torch {result['torch']}; median of {result['steps']} steps each, alternating"
    )
    print(f"{'':16}{'step (s)':>10}{'tokens/s':>12}{'MFU':>8}{'step peak (GiB)':>17}")
    for name, row in (("shardlang", ours), ("hand-written", theirs)):
        mfu = row["tokens_per_s"] * flops / (result["world"] * PEAK_BF16[card]) if card else float("nan")
        print(
            f"{name:16}{row['median_s']:>10.4f}{row['tokens_per_s']:>12.0f}{mfu:>8.1%}{result['transient_peak'][name] / 2**30:>17.2f}"
        )
    print(f"throughput ratio shardlang / hand-written: {ours['tokens_per_s'] / theirs['tokens_per_s']:.4f}")
    peak_ratio = result["transient_peak"]["shardlang"] / max(result["transient_peak"]["hand-written"], 1)
    print(f"step peak memory ratio: {peak_ratio:.4f}")
    same = result["counts"]["shardlang"] == result["counts"]["hand-written"]
    print(
        f"collectives of one forward+backward: {'identical' if same else 'DIFFERENT'}: {result['counts']['shardlang']}"
        + ("" if same else f" vs {result['counts']['hand-written']}")
    )
    measured = {"params": result["params_mem"], "grads": result["grads_mem"], "optimizer": result["optimizer_mem"]}
    if args.explain:
        predicted = json.loads(Path(args.explain).read_text())["this_rank"]
        print(f"{'rank 0 memory':16}{'explain':>12}{'measured':>12}{'ratio':>8}")
        for key in ("params", "grads", "optimizer"):
            print(
                f"{key:16}{predicted[key] / 2**20:>11.1f}M{measured[key] / 2**20:>11.1f}M{measured[key] / max(predicted[key], 1):>8.3f}"
            )
    print("RESULT " + json.dumps({k: v for k, v in result.items()}))


if __name__ == "__main__":
    main()
