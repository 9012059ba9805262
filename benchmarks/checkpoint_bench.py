"""Checkpoint save and load of a Llama-style model at world 4 on the CPU (gloo), beside plain
`torch.save`/`torch.load` of the same model's unsharded state dict in one process.

    python benchmarks/checkpoint_bench.py [--dim 1024] [--layers 8] [--repeat 3] [--optimizer] [--device cpu|cuda]

The model is examples/llama.py's Transformer at a size set by the flags (default 170M parameters,
680 MB in float32). shardlang saves under plans/llama_2d.sl (dp 2 x tp 2) and loads under the same
plan, under tp 4 (every tensor resharded) and in one unsharded process. Each row is the median of
`--repeat` runs; GB/s is the checkpoint's bytes over the wall time. Both sides write durably: DCP
fsyncs its files (and shardlang the directory it publishes), so the torch.save row fsyncs too. With
`--device cuda` the model lives on the GPUs (nccl) and the torch rows save and load CUDA tensors. Loads
read from the page cache on both sides. shardlang's loads read into new tensors and copy them into the
model only once all were read (what keeps a failed load from leaving the model half loaded), so compare
them with "torch.load + load_state_dict". CPU timings are noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SIZE = {"dim": 1024, "layers": 8, "vocab": 32000}


def build_model() -> torch.nn.Module:
    from examples.llama import Transformer

    dim = SIZE["dim"]
    return Transformer(
        vocab=SIZE["vocab"], dim=dim, heads=dim // 64, layers=SIZE["layers"], hidden=dim * 11 // 4, seq=64
    )


def _on_rank(size: dict, plan_params: dict, directory: str, action: str, optimizer: bool) -> float:
    """Build under plans/llama_2d.sl, then save or load; this rank's seconds between two barriers (the
    optimizer's state is created first, as a training step would, and is not timed)."""
    import torch.distributed as dist

    import shardlang
    from shardlang.runtime.apply import apply_plan

    SIZE.update(size)
    plan = shardlang.load(ROOT / "plans/llama_2d.sl", plan_params, world_size=dist.get_world_size())
    model = plan.build(build_model)
    apply_plan(plan, model)
    optim = torch.optim.Adam(model.parameters()) if optimizer else None
    if optim is not None:
        get_optimizer_state_dict(model, optim)  # creates Adam's state
    dist.barrier()
    start = time.perf_counter()
    if action == "save":
        shardlang.save_checkpoint(model, directory, optim)
    else:
        shardlang.load_checkpoint(model, directory, optim)
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=SIZE["dim"])
    parser.add_argument("--layers", type=int, default=SIZE["layers"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--optimizer", action="store_true", help="save and load Adam's state too")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    SIZE.update(dim=args.dim, layers=args.layers)

    import shardlang
    from shardlang.launch.workers import WorkerPool

    work = Path(tempfile.mkdtemp(prefix="shardlang-bench-", dir=args.dir))
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    rows = []
    try:
        torch.manual_seed(0)
        with device:
            model = build_model()
        optim = None
        state = model.state_dict()
        if args.optimizer:
            optim = torch.optim.Adam(model.parameters())
            get_optimizer_state_dict(model, optim)
            state = {"model": state, "optimizer": optim.state_dict()}
        params = sum(p.numel() for p in model.parameters())

        def torch_save() -> float:
            start = time.perf_counter()
            torch.save(state, work / "plain.pt")
            with open(work / "plain.pt", "rb") as f:
                os.fsync(f.fileno())
            return time.perf_counter() - start

        def torch_load() -> float:
            start = time.perf_counter()
            torch.load(work / "plain.pt", weights_only=True, map_location=device)
            _sync(device)
            return time.perf_counter() - start

        def torch_load_into_model() -> float:
            with device:
                fresh = build_model()
            fresh_optim = torch.optim.Adam(fresh.parameters()) if args.optimizer else None
            start = time.perf_counter()
            loaded = torch.load(work / "plain.pt", weights_only=True, map_location=device)
            fresh.load_state_dict(loaded["model"] if args.optimizer else loaded)
            if fresh_optim is not None:
                fresh_optim.load_state_dict(loaded["optimizer"])
            _sync(device)
            return time.perf_counter() - start

        rows.append(("torch.save, 1 process, unsharded (+ fsync)", _median(torch_save, args.repeat)))
        rows.append(("torch.load, 1 process, unsharded", _median(torch_load, args.repeat)))
        rows.append(("torch.load + load_state_dict, 1 process", _median(torch_load_into_model, args.repeat)))

        with WorkerPool(args.nproc, "nccl" if args.device == "cuda" else "gloo") as pool:

            def on_ranks(action: str, params: dict) -> float:
                return max(
                    pool.run(_on_rank, dict(SIZE), params, str(work / "ckpt"), action, args.optimizer, timeout_s=1800)
                )

            half = args.nproc // 2
            rows.append(
                (
                    f"shardlang save, world {args.nproc} (dp {args.nproc // half} x tp {half})",
                    _median(lambda: on_ranks("save", {"tp": half}), args.repeat),
                )
            )
            rows.append(("shardlang load, same plan", _median(lambda: on_ranks("load", {"tp": half}), args.repeat)))
            rows.append(
                (
                    f"shardlang load, resharded to tp {args.nproc}",
                    _median(lambda: on_ranks("load", {"tp": args.nproc}), args.repeat),
                )
            )

        def into_one_process() -> float:
            with device:
                fresh = build_model()
            optim = torch.optim.Adam(fresh.parameters()) if args.optimizer else None
            start = time.perf_counter()
            shardlang.load_checkpoint(fresh, work / "ckpt", optim)
            _sync(device)
            return time.perf_counter() - start

        rows.append(("shardlang load, 1 unsharded process", _median(into_one_process, args.repeat)))
        nbytes = shardlang.read_checkpoint(work / "ckpt").bytes  # the same tensors torch.save wrote
    finally:
        shutil.rmtree(work, ignore_errors=True)

    what = "model + Adam state" if args.optimizer else "model"
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"Llama-style, {params / 1e6:.0f}M parameters ({what}: {nbytes / 1e9:.2f} GB in float32), {where}, "
        f"torch {torch.__version__}, {os.cpu_count()} cores, median of {args.repeat}"
    )
    print(f"{'':<46}{'seconds':>9}{'GB/s':>8}")
    for label, seconds in rows:
        print(f"{label:<46}{seconds:>9.2f}{nbytes / seconds / 1e9:>8.2f}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median(measure, repeat: int) -> float:
    """The median of `repeat` calls of `measure`, which returns the seconds it timed."""
    return statistics.median(measure() for _ in range(repeat))


if __name__ == "__main__":
    main()
