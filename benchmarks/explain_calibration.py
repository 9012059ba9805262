"""explain's predictions against the GPUs: for each plan, the peak memory and step time explain predicts
(on the CPU, meta device, in-process on rank 0) beside what the GPUs measure for the ~1B Llama.

    torchrun --nproc-per-node 2 benchmarks/explain_calibration.py [--plans fsdp,fsdp_ac,tp_fsdp,tp_fsdp_ac]
        [--batch 4] [--steps 10] [--warmup 3] [--gpu h100|h200|auto]
    torchrun --nproc-per-node 2 benchmarks/explain_calibration.py --dry-run     # CPU, gloo, tiny model

Plans are benchmarks/plans/llama_1b_<name>.sl (fsdp_offload: FSDP with `offload = cpu`). Measured, per
plan: the model built on meta and materialised by the plan, fused AdamW (whose CPU kernel steps the
parameters an offloading plan keeps on the CPU), `--warmup` steps, then `--steps` steps each after
torch.cuda.reset_peak_memory_stats: the peak is the largest torch.cuda.max_memory_allocated over them
(the GPU's alone, absolute: parameters, optimizer states and all that is on it), the time the median
step (synchronised); `host` is what the parameters, gradients and optimizer states on the CPU hold
just before the last step's zero_grad (0 without offload). Predicted: `shardlang explain` of the same
plan, world, batch and card. Rank 0 prints one table and a RESULT line of JSON.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import shardlang  # noqa: E402
from benchmarks.gpu_throughput import NoMemory, join  # noqa: E402
from shardlang.runtime.apply import apply_plan  # noqa: E402


def card_kind(name: str) -> str:
    for kind in ("h200", "h100", "a100", "b200"):
        if kind in name.lower():
            return kind
    return "h100"


def predict(plan, world: int, batch: int, gpu: str, model_file) -> dict:
    from shardlang.explain.options import ExplainOptions
    from shardlang.explain.simulate import explain
    from shardlang.explain.timing import hardware

    start = time.perf_counter()
    e = explain(
        plan, model_file.build_on_meta(), ExplainOptions(world, batch=batch, hardware=hardware(gpu)), model_file
    )
    if e.peak is None:
        raise SystemExit(f"explain could not simulate the step: {e.notes}")
    return {
        "peak": e.peak.bytes,
        "categories": dict(e.peak.categories),
        "step_s": e.time.seconds,
        "compute_s": e.time.compute,
        "host_s": e.time.host,
        "exposed_s": e.time.exposed,
        "host": e.peak.host,
        "h2d_s": e.time.h2d,
        "d2h_s": e.time.d2h,
        "cpu_s": e.time.cpu,
        "explain_s": time.perf_counter() - start,
    }


def measure(plan, module, batch: int, steps: int, warmup: int, cuda: bool, memory) -> dict:
    rank = dist.get_rank()
    tp = 2 if any(b for b in plan.parallelize) else 1
    tokens = module.example_input(batch, torch.Generator().manual_seed(rank // tp))
    tokens = tokens.cuda() if cuda else tokens
    torch.manual_seed(0)
    model = plan.build(module.build_model)
    apply_plan(plan, model)
    # Fused on the GPU's parameters, and on the CPU's where the plan offloads (torch has a CPU kernel):
    # explain's simulated step uses it too. The dry run, all on the CPU, takes the CPU kernel throughout.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> float:
        memory.synchronize()
        start = time.perf_counter()
        loss = module.loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss
        memory.synchronize()
        return time.perf_counter() - start

    for _ in range(warmup):
        step()
    times, peak = [], 0
    for _ in range(steps):
        memory.reset_peak_memory_stats()
        times.append(step())
        peak = max(peak, memory.max_memory_allocated())
    # One more step, untimed, to see what the CPU holds with the gradients there (all of it in a dry run).
    module.loss(model(tokens), tokens).backward()
    optimizer.step()
    host = on_cpu(model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    model = optimizer = None  # freed before the next plan builds
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"peak": peak, "step_s": statistics.median(times), "host": host}


def on_cpu(model, optimizer) -> int:
    """Bytes of the parameters, gradients and optimizer states whose (local) storage is on the CPU."""
    from torch.distributed.tensor import DTensor

    storages = {}
    tensors = [t for p in model.parameters() for t in (p, p.grad)]
    tensors += [t for state in optimizer.state.values() for t in state.values()]
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            if local.device.type == "cpu":
                storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default="fsdp,fsdp_ac,tp_fsdp,tp_fsdp_ac")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gpu", default="auto", help="the card explain predicts for (default: the one found)")
    parser.add_argument("--dry-run", action="store_true", help="check this script on CPU (gloo) with the tiny model")
    args = parser.parse_args()
    cuda = not args.dry_run
    join(args.dry_run)
    rank, world = dist.get_rank(), dist.get_world_size()
    memory = torch.cuda if cuda else NoMemory()
    card = torch.cuda.get_device_name() if cuda else "cpu"
    gpu = card_kind(card) if args.gpu == "auto" else args.gpu

    from shardlang.runtime.modelfile import load_model_file

    if args.dry_run:
        import examples.llama as module

        model_file = load_model_file(str(ROOT / "examples" / "llama.py"))
    else:
        from benchmarks import llama_1b as module

        model_file = load_model_file(None, entry="benchmarks.llama_1b:build_model")

    rows = []
    for name in filter(None, args.plans.split(",")):
        plan = shardlang.load(ROOT / "benchmarks" / "plans" / f"llama_1b_{name}.sl")
        predicted = predict(plan, world, args.batch, gpu, model_file) if rank == 0 else None
        dist.barrier()
        measured = measure(plan, module, args.batch, args.steps, args.warmup, cuda, memory)
        peaks = [None] * world
        dist.all_gather_object(peaks, measured["peak"])
        measured["peak_max_rank"] = max(peaks)
        rows.append({"plan": name, "predicted": predicted, "measured": measured})

    if rank == 0:
        print(
            f"explain against {world} x {card} (torch {torch.__version__}, {time.strftime('%Y-%m-%d')}); "
            f"1B Llama, batch {args.batch} per replica, median of {args.steps} steps after {args.warmup}; "
            f"predicted for {gpu}"
        )
        print(
            f"{'plan':12}{'peak pred':>11}{'peak meas':>11}{'ratio':>8}"
            f"{'step pred':>11}{'step meas':>11}{'ratio':>8}{'explain':>9}"
        )
        for row in rows:
            p, m = row["predicted"], row["measured"]
            print(
                f"{row['plan']:12}{p['peak'] / 2**30:>10.2f}G{m['peak'] / 2**30:>10.2f}G"
                f"{m['peak'] / max(p['peak'], 1):>8.3f}{p['step_s'] * 1000:>9.1f}ms{m['step_s'] * 1000:>9.1f}ms"
                f"{m['step_s'] / max(p['step_s'], 1e-12):>8.3f}{p['explain_s']:>8.1f}s"
            )
        print("ratios are measured / predicted; peak is rank 0's (the largest rank's in the RESULT line)")
        for row in rows:
            p, m = row["predicted"], row["measured"]
            if p["host"]:
                print(
                    f"{row['plan']}: CPU memory {p['host'] / 2**30:.2f}G predicted, {m['host'] / 2**30:.2f}G measured; "
                    f"predicted CPU step {p['cpu_s'] * 1000:.1f}ms, H2D {p['h2d_s'] * 1000:.1f}ms and "
                    f"D2H {p['d2h_s'] * 1000:.1f}ms (overlapped)"
                )
        print("RESULT " + json.dumps({"card": card, "torch": torch.__version__, "world": world, "rows": rows}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
