"""What explain predicts for issue 43's one-node plans, at world 8 on the CPU: torchtitan's Llama3 1B and 8B
(FSDP 8, TP 2 x FSDP 4, TP 4 x FSDP 2; the 8B also pp 2 x tp 2 x dp 2) and its Qwen3-MoE (EP 2 x FSDP 4, EP 4
x FSDP 2, EP 8), each the plan `benchmarks/titan_compare.py --nproc-per-node 8` times, with torchtitan's 4 x
2048 tokens per GPU. One table: each plan's predicted peak per GPU (the step's plus the resident parameters
and optimizer states), step time and tokens/s on the chosen GPU, to set beside the 8-GPU measurements when an
8-GPU machine is lent (benchmarks/RESULTS.md).

    python benchmarks/node8_explain.py --gpu h200
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORLD = 8
#: (model file module, plan, -D params): titan_compare's `--size`, `--config` and `--tp`/`--ep`
RUNS = (
    ("titan_1b", "titan_1b_fsdp", {}),
    ("titan_1b", "titan_1b_tp_fsdp", {"tp": "2"}),
    ("titan_1b", "titan_1b_tp_fsdp", {"tp": "4"}),
    ("titan_8b", "titan_8b_fsdp", {}),
    ("titan_8b", "titan_8b_tp_fsdp", {"tp": "2"}),
    ("titan_8b", "titan_8b_tp_fsdp", {"tp": "4"}),
    ("titan_8b", "titan_8b_pp_tp_fsdp", {}),
    ("titan_moe", "titan_moe_ep", {"ep": "2"}),
    ("titan_moe", "titan_moe_ep", {"ep": "4"}),
    ("titan_moe", "titan_moe_ep", {"ep": "8"}),
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h200", choices=("h100", "h200"))
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import importlib

    import torch

    import shardlang

    print("| model | plan | params | predicted peak | predicted step | tokens/s | seconds to explain |")
    print("|---|---|---|---|---|---|---|")
    for module, name, params in RUNS:
        source = importlib.import_module(f"benchmarks.{module}")
        plan = shardlang.load(ROOT / "benchmarks" / "plans" / f"{name}.sl", params, world_size=WORLD)
        with torch.device("meta"):
            model = source.build_model()
        start = time.perf_counter()
        explained = plan.explain(
            model, WORLD, example_input=source.example_input, loss=source.loss, batch=args.batch, gpu=args.gpu
        )
        seconds = time.perf_counter() - start
        said = " ".join(f"{k}={v}" for k, v in params.items()) or "-"
        if explained.time is None:
            why = next((n for n in explained.notes if n.startswith("no collectives")), "no step")
            print(f"| {module} | {name} | {said} | - | - | {why} | {seconds:.0f} |", flush=True)
            continue
        peak = explained.peak.bytes / 2**30
        step = explained.time.seconds
        tokens = explained.time.tokens_per_s
        print(
            f"| {module} | {name} | {said} | {peak:.1f} GiB | {step * 1e3:.1f} ms | {tokens:,.0f} | {seconds:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
