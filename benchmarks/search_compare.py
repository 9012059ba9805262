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

`--model 8b` (torchtitan's Llama3 8B, where memory binds): the two sides do not fit on the GPUs together, so
each layout runs in a process of its own (`titan_compare.py --side`): torchtitan's default and compiled
(`--titan-ac` for its checkpointing) once a round beside each plan, `--runs` rounds in alternating order,
a side that runs out of memory reported so. `--candidates DIR` measures a search already run elsewhere.
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
MODELS = {
    "1b": ("benchmarks/titan_1b.py", "fsdp"),
    "8b": ("benchmarks/titan_8b.py", "fsdp"),
    "moe": ("benchmarks/titan_moe.py", "moe"),
}


def arguments(argv=None) -> argparse.Namespace:
    sys.path.insert(0, str(ROOT))  # run as a script: benchmarks/ is on the path, the project root is not
    from benchmarks.titan_compare import TITAN_AC

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="GPUs (the search's world)")
    parser.add_argument(
        "--model",
        default="1b",
        choices=sorted(MODELS),
        help="torchtitan's Llama3 1B (benchmarks/titan_1b.py), its 8B (benchmarks/titan_8b.py: the two sides "
        "do not fit on the GPUs together, so each runs in a process of its own, titan_compare's --side, "
        "alternating which goes first) or its Qwen3-MoE (benchmarks/titan_moe.py, against torchtitan's FSDP "
        "without expert parallelism: titan_compare's --config moe)",
    )
    parser.add_argument(
        "--titan-ac",
        choices=TITAN_AC,
        default="none",
        help="torchtitan compiled's activation checkpointing (its fastest layout where the model does not fit "
        "without it; torchtitan's default stays without)",
    )
    parser.add_argument(
        "--reverse",
        type=int,
        choices=(0, 1),
        default=0,
        help="with --model 8b: 1 runs the first round's processes in reverse order (a second device call's rounds "
        "continuing the alternation of the first's)",
    )
    parser.add_argument(
        "--titan-accumulation",
        type=int,
        default=1,
        help="with --model 8b: torchtitan's micro-batches per step (its gradient accumulation), the same tokens",
    )
    parser.add_argument(
        "--candidates",
        type=Path,
        help="a folder where `shardlang search --candidates` already wrote them (e.g. on a machine with more "
        "cores): measure those instead of searching here",
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
        "--no-titan-default",
        action="store_true",
        help="with --model 8b: skip torchtitan's default layout (measured in another call)",
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
    """One titan_compare run of `plan` against torchtitan (eager, or compiled with its loss, with --titan-ac),
    both built in one process group: its RESULT."""
    return _titan_compare(args, plan, order, titan_compiled, "both")


def apart(args, plans: list[Path]) -> tuple[dict, dict]:
    """For the 8B, whose two sides do not fit on the GPUs together: each side in a process of its own.
    torchtitan does not depend on the plan, so each of its layouts (default; compiled, with --titan-ac) runs
    once a round beside each plan; --runs rounds, the odd ones in reverse order. The medians: per plan
    (step, peak, whole peak) and per torchtitan layout, None where it ran out of memory every time."""
    jobs = [("torchtitan", False)] * (not args.no_titan_default) + [("torchtitan", True)] * (not args.no_titan_compiled)
    jobs += [("shardlang", plan) for plan in plans]
    seen: dict = {job: [] for job in jobs}
    for round_ in range(args.runs):
        for side, what in jobs if (round_ + args.reverse) % 2 == 0 else jobs[::-1]:
            plan = what if side == "shardlang" else plans[0]
            compiled = what is True
            result = _titan_compare(args, plan, "shardlang-first", compiled, side)
            seen[(side, what)].append(None if result.get("oom") else result[side] | {"card": result["card"]})
            print(f"round {round_ + 1}: {_named(side, what, args)}: {_said(seen[(side, what)][-1])}", flush=True)

    def median(runs):
        fit = [r for r in runs if r is not None]
        if not fit:
            return None
        return {
            "median_s": statistics.median(r["median_s"] for r in fit),
            "peak_bytes": max(r["peak_bytes"] for r in fit),
            "whole_peak_bytes": max(r["absolute_peak_bytes"] for r in fit),
            "card": fit[0]["card"],
            "ooms": len(runs) - len(fit),
        }

    titan = {compiled: median(seen.get(("torchtitan", compiled), [])) for compiled in (False, True)}
    return {plan: median(seen[("shardlang", plan)]) for plan in plans}, titan


def _named(side: str, what, args) -> str:
    if side == "shardlang":
        return what.stem
    return f"torchtitan {'compiled (blocks and loss, ac ' + args.titan_ac + ')' if what else 'default'}"


def _said(run: dict | None) -> str:
    if run is None:
        return "out of memory"
    said = f"{run['median_s'] * 1e3:.1f} ms, whole peak {run['absolute_peak_bytes'] / 2**30:.1f} GiB"
    if "reserved_peak_bytes" in run:  # on a GPU: what the search's memory budget is calibrated against
        said += (
            f", reserved peak {run['reserved_peak_bytes'] / 2**30:.1f} of {run['capacity_bytes'] / 2**30:.1f} GiB"
            f", {run['outside_torch_bytes'] / 2**30:.2f} GiB outside torch, {run['alloc_retries']} allocator retries"
        )
    return said


def _titan_compare(args, plan: Path, order: str, titan_compiled: bool, side: str) -> dict:
    config = MODELS[args.model][1]
    command = ["torchrun", "--nproc-per-node", str(args.nproc), "benchmarks/titan_compare.py", "--config", config]
    command += ["--plan", str(plan), "--order", order, "--steps", str(args.steps), "--batch", str(args.batch)]
    command += ["--side", side] + (["--size", "8b"] if args.model == "8b" else [])
    accumulation = args.titan_accumulation if side == "torchtitan" else _accumulation(plan)
    command += ["--accumulation", str(accumulation)]
    command += ["--compile", "--compile-loss", "--titan-ac", args.titan_ac] if titan_compiled else []
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    found = re.search(r"^RESULT (\{.*\})$", done.stdout, re.M)
    if not found:
        raise SystemExit(f"titan_compare failed on {plan}:\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(found.group(1))


def _accumulation(plan: Path) -> int:
    """The accumulation steps search wrote in the plan's header (1 where it says none)."""
    found = re.search(r"micro-batch \d+ x (\d+) accumulation", plan.read_text())
    return int(found.group(1)) if found else 1


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
        if args.candidates:
            plans = sorted(args.candidates.glob("[0-9][0-9].sl"))
            print(f"search: {len(plans)} plans fit, read from {args.candidates}")
        else:
            plans, seconds = searched(args, Path(folder))
            print(f"search: {len(plans)} plans fit, {seconds:.0f} s on this host's CPUs")
        if args.model == "8b":
            chosen = [p for n, p in enumerate(plans[: args.top], 1) if not args.ranks or n in args.ranks]
            table_apart(args, chosen, *apart(args, chosen))
            return
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


def table_apart(args, plans: list[Path], ours: dict, titan: dict) -> None:
    """The 8B's table: each plan's medians beside torchtitan's default and compiled, measured apart."""

    def step(run):
        return f"{run['median_s'] * 1e3:.1f} ms" if run else "out of memory"

    def ratio(run, theirs):
        return f"{theirs['median_s'] / run['median_s']:.3f}" if run and theirs else "-"

    for compiled, run in titan.items():
        name = _named("torchtitan", compiled, args)
        peak = f", whole peak {run['whole_peak_bytes'] / 2**30:.1f} GiB" if run else ""
        print(f"{name}: {step(run)}{peak}")
    print(
        "| # | plan | predicted step | measured step | predicted peak | measured whole peak | / torchtitan default "
        "| / torchtitan compiled |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for plan in plans:
        name, predicted_step, peak = predicted(plan)
        run = ours[plan]
        whole = f"{run['whole_peak_bytes'] / 2**30:.1f} GiB" if run else "-"
        print(
            f"| {plan.stem} | {name} | {predicted_step * 1e3:.1f} ms | {step(run)} | {peak:.1f} GiB | {whole} "
            f"| {ratio(run, titan[False])} | {ratio(run, titan[True])} |"
        )
    fit = [run["median_s"] for run in ours.values() if run]
    if ours.get(plans[0]) and fit:
        print(f"the first plan's measured step is {ours[plans[0]]['median_s'] / min(fit):.3f} x the fastest measured")
    card = next((run["card"] for run in [*ours.values(), *titan.values()] if run), "?")
    print(f"card: {card}; medians of {args.runs} rounds")


def _cpu_only() -> dict:
    import os

    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


if __name__ == "__main__":
    main()
