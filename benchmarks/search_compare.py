"""`shardlang search` measured (issue 42): the plan it writes for torchtitan's Llama3 1B (or its Qwen3-MoE
with `--model moe`) and its runners-up, each timed against torchtitan's default layout by
benchmarks/titan_compare.py on the GPUs, beside what explain predicted for it. One table: predicted and
measured step time, tokens/s and peak memory per candidate, and each candidate's throughput over torchtitan's
default (FSDP over every GPU, eager, no activation checkpointing) and over torchtitan compiled (blocks and
loss, its fastest layout at 2 GPUs).

    python benchmarks/search_compare.py --nproc 2 --gpu h200 --top 5 --runs 3

runs `shardlang search benchmarks/titan_1b.py --world 2 --tokens-per-step <batch x 2048 x 2>
--candidates DIR` on this host's CPUs, then for each of the best `--top` candidates `--runs` runs of
titan_compare in each build order against torchtitan's default, and one against torchtitan compiled. Each
titan_compare run alternates the two sides step by step (30 steps each after warm-up): the medians of the
runs are reported. Results (card, date, numbers) go to benchmarks/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEQ = 2048
#: --model: the model file searched, and titan_compare's config for torchtitan's default layout of it
MODELS = {"1b": ("benchmarks/titan_1b.py", "fsdp"), "moe": ("benchmarks/titan_moe.py", "moe")}


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="GPUs (the search's world)")
    parser.add_argument(
        "--model",
        default="1b",
        choices=sorted(MODELS),
        help="torchtitan's Llama3 1B (benchmarks/titan_1b.py) or its Qwen3-MoE (benchmarks/titan_moe.py, "
        "against torchtitan's FSDP without expert parallelism: titan_compare's --config moe)",
    )
    parser.add_argument("--gpu", default="h200", choices=("h100", "h200"))
    parser.add_argument("--batch", type=int, default=4, help="sequences per GPU per step (titan_compare's --batch)")
    parser.add_argument("--top", type=int, default=5, help="candidates measured, best first")
    parser.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        help="measure only these of the best --top (1-based: `--ranks 4 5` where one device call cannot hold "
        "all five; the search is deterministic, so a later call measures the same plans)",
    )
    parser.add_argument("--runs", type=int, default=3, help="titan_compare runs per build order and candidate")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=0, help="search's explain processes (default: its own)")
    parser.add_argument(
        "--orders",
        nargs="+",
        default=["shardlang-first", "titan-first"],
        choices=("shardlang-first", "titan-first"),
        help="titan_compare's build orders, each run --runs times (default both)",
    )
    parser.add_argument(
        "--no-titan-compiled", action="store_true", help="skip the run against torchtitan compiled (blocks and loss)"
    )
    return parser.parse_args(argv)


def searched(args, folder: Path) -> tuple[list[Path], float]:
    """The search's candidate plans, best first, and how long it took."""
    tokens = args.batch * SEQ * args.nproc
    command = [sys.executable, "-m", "shardlang", "search", MODELS[args.model][0], "--world", str(args.nproc)]
    command += ["--gpu", args.gpu, "--tokens-per-step", str(tokens), "--check", "0", "--candidates", str(folder)]
    command += ["--jobs", str(args.jobs)] if args.jobs else []
    command += ["-o", str(folder / "chosen.sl")]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=_cpu_only())
    if done.returncode:
        raise SystemExit(f"search failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return sorted(folder.glob("[0-9][0-9].sl")), time.perf_counter() - start


def measured(args, plan: Path, order: str, titan_compiled: bool) -> dict:
    """One titan_compare run of `plan` against torchtitan (eager, or compiled with its loss): its RESULT."""
    config = MODELS[args.model][1]
    command = ["torchrun", "--nproc-per-node", str(args.nproc), "benchmarks/titan_compare.py", "--config", config]
    command += ["--plan", str(plan), "--order", order, "--steps", str(args.steps), "--batch", str(args.batch)]
    command += ["--compile", "--compile-loss"] if titan_compiled else []
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    found = re.search(r"^RESULT (\{.*\})$", done.stdout, re.M)
    if not found:
        raise SystemExit(f"titan_compare failed on {plan}:\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(found.group(1))


def predicted(plan: Path) -> tuple[str, float, float]:
    """The candidate's name, predicted step (s) and peak (GiB), from the header search wrote."""
    header = plan.read_text().splitlines()[1]
    name = header.strip("# ").split(":")[0]
    step = float(re.search(r"step ([0-9.]+) ms", header).group(1)) / 1e3
    peak = float(re.search(r"peak ([0-9.]+) GiB", header).group(1)) if "GiB" in header else 0.0
    return name, step, peak


def main(argv=None) -> None:
    args = arguments(argv)
    with tempfile.TemporaryDirectory() as folder:
        plans, seconds = searched(args, Path(folder))
        print(f"search: {len(plans)} plans fit, {seconds:.0f} s on this host's CPUs")
        rows = []
        for number, plan in enumerate(plans[: args.top], 1):
            if args.ranks and number not in args.ranks:
                continue
            runs = [measured(args, plan, order, False) for order in args.orders for _ in range(args.runs)]
            fastest = None if args.no_titan_compiled else measured(args, plan, "shardlang-first", True)
            name, step, peak = predicted(plan)
            ours = statistics.median(r["shardlang"]["median_s"] for r in runs)
            rows.append(
                (
                    number,
                    name,
                    step,
                    ours,
                    peak,
                    max(r["shardlang"]["peak_bytes"] for r in runs) / 2**30,
                    statistics.median(r["throughput_ratio"] for r in runs),
                    fastest["throughput_ratio"] if fastest else float("nan"),
                    runs[0]["card"],
                )
            )
            each = ", ".join(f"{r['throughput_ratio']:.3f} {r['order']}" for r in runs)
            print(
                f"measured #{number} {name}: {ours * 1e3:.1f} ms (predicted {step * 1e3:.1f} ms), peak "
                f"{rows[-1][5]:.1f} GiB, / torchtitan default {rows[-1][6]:.3f} ({each}), / compiled "
                f"{rows[-1][7]:.3f}",
                flush=True,
            )
    print(
        "| # | plan | predicted step | measured step | predicted peak | measured peak | / torchtitan default "
        "| / torchtitan compiled |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for number, name, step, ours, peak, real_peak, default, compiled, _ in rows:
        print(
            f"| {number} | {name} | {step * 1e3:.1f} ms | {ours * 1e3:.1f} ms | {peak:.1f} GiB | {real_peak:.1f} GiB "
            f"| {default:.3f} | {compiled:.3f} |"
        )
    if rows and rows[0][0] == 1:
        best = min(r[3] for r in rows)
        print(f"the chosen plan's measured step is {rows[0][3] / best:.3f} x the fastest of the {len(rows)} measured")
    if rows:
        print(f"card: {rows[0][8]}")


def _cpu_only() -> dict:
    import os

    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


if __name__ == "__main__":
    main()
