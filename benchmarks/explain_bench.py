"""`shardlang explain` of the Llama plan on the 80-layer, 8192-wide structure at a simulated world of
1024 (tp 8): wall time of the whole command and its peak RSS.

    python benchmarks/explain_bench.py [--world 1024] [--repeat 3]

Targets (2-core development machine): under 15 s and 2 GiB RSS with the step's peak memory and time
(explain always tracks them now); `--fit 80GiB` under 60 s. Peak RSS shows that no parameter memory
is allocated (the model would need 280 GiB in float32). The default extrapolates the step from a few
of the 80 blocks; --full-step runs all of them, and the two must report the same collectives, peak
and time.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    base = [
        sys.executable,
        "-m",
        "shardlang",
        "explain",
        "plans/llama_2d.sl",
        "--entry",
        "examples.llama:build_large",
        "--world",
        str(args.world),
        "-D",
        "tp=8",
        "--format",
        "json",
    ]
    rows = []
    runs = (
        ("explain (step on 2, 3, 4 blocks)", base),
        ("explain --full-step (all 80 blocks)", [*base, "--full-step"]),
        ("explain --no-step", [*base, "--no-step"]),
        ("explain --fit 80GiB", [*base, "--fit", "80GiB"]),
        ("import shardlang and torch only", [sys.executable, "-c", "import shardlang.explain.simulate"]),
    )
    collectives, fit = [], None
    for label, command in runs:
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            done = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
            times.append(time.perf_counter() - start)
        rows.append((label, min(times), sorted(times)[len(times) // 2]))
        if "--format" in command and "--no-step" not in command:
            data = json.loads(done.stdout)
            collectives.append((data["collectives"], data.get("peak"), data.get("time")))
            if data.get("fit"):
                fit = data["fit"]
    if collectives[0] != collectives[1]:
        sys.exit("the extrapolated step's collectives, peak or time differ from the full step's")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(
        f"shardlang explain plans/llama_2d.sl, 80 layers x 8192, world {args.world} (dp {args.world // 8} x tp 8); best of {args.repeat}"
    )
    print(f"{'':36}{'best':>8}{'median':>8}")
    for label, best, median in rows:
        print(f"{label:36}{best:>7.1f}s{median:>7.1f}s")
    print(f"peak RSS of any run: {peak:.0f} MiB; extrapolated and full step report the same collectives, peak and time")
    step = collectives[0]
    print(
        f"rank 0: peak {step[1]['bytes'] / 2**30:.2f} GiB at batch {step[1]['batch']}, estimated step "
        f"{step[2]['seconds'] * 1000:.1f} ms on {step[2]['gpu']}; --fit 80GiB: batch {fit['batch']} "
        f"({len(fit['tried'])} steps simulated)"
    )


if __name__ == "__main__":
    main()
