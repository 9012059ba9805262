"""`shardlang lint` with its simulated training step (issue 24), against `--no-step`: wall time of the whole
command and its peak RSS, on the 1B benchmark model at world 8 and on the 80-layer, 8192-wide Llama structure
at world 1024 (dp 128 x tp 8), and lint without a model.

    python benchmarks/lint_bench.py [--repeat 3]

Targets (2-core development machine): the 1B model at world 8 under 15 s; the 80-layer structure at world
1024 under 30 s and 2 GiB; lint without a model under 1 s. CPU timings on a shared machine are noisy: the
best and the median of `--repeat` runs are printed.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = (
    ("1B, tp 2 x fsdp, world 8", ["benchmarks/plans/llama_1b_tp_fsdp.sl", "benchmarks/llama_1b.py", "--world", "8"]),
    (
        "80 x 8192, world 1024",
        ["plans/llama_2d.sl", "--entry", "examples.llama:build_large", "--world", "1024", "-D", "tp=8"],
    ),
)


def timed(command: list[str], repeat: int) -> tuple[float, float, str, float]:
    """Best and median seconds of `repeat` runs, the last run's last line, and the largest RSS (MiB) of one."""
    times, last, rss = [], "", 0.0
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        last = (done.stdout.strip().splitlines() or [done.stderr.strip()[-200:]])[-1]
        rss = max(rss, max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024)
    return min(times), sorted(times)[len(times) // 2], last, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    lint = [sys.executable, "-m", "shardlang", "lint"]
    rows = []
    for label, arguments in CASES:
        for mode in ([], ["--no-step"]):
            best, median, last, rss = timed([*lint, *arguments, *mode], args.repeat)
            rows.append((f"{label}{' --no-step' if mode else ''}", best, median, rss, last))
    best, median, last, rss = timed([*lint, "plans/llama_2d.sl", "--world", "8"], args.repeat)
    rows.append(("no model, world 8", best, median, rss, last))
    print(f"shardlang lint, best and median of {args.repeat} (peak RSS is the largest any child reached so far)")
    print(f"{'':38}{'best':>8}{'median':>8}{'RSS MiB':>9}  what it said")
    for label, best, median, rss, last in rows:
        print(f"{label:38}{best:>7.1f}s{median:>7.1f}s{rss:>9.0f}  {last[:90]}")


if __name__ == "__main__":
    main()
