"""Wall time of `shardlang apply` on every example plan at world 4 on the CPU, and of each check.

    python benchmarks/apply_examples.py [--nproc 4]

Runs the real command (`python -m shardlang apply PLAN MODEL --nproc N --json`) once per plan: the
wall time includes starting the workers. Target: the README's main command under 60 s on a 2-core
machine. CPU timings are noisy; compare them only within one run.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ("init_device", "placements", "module_states", "comms", "gradients")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    rows = []
    for plan in sorted((ROOT / "plans").glob("*.sl")):
        model = re.search(r"Model: (\S+\.py)", plan.read_text()).group(1)
        start = time.perf_counter()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "shardlang",
                "apply",
                str(plan.relative_to(ROOT)),
                model,
                "--nproc",
                str(args.nproc),
                "--json",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - start
        report = json.loads(done.stdout)
        seconds = {c["check"]: c["seconds"] for c in report["checks"]}
        rows.append((plan.stem, report["ok"], wall, report["seconds"], seconds))

    print(f"shardlang apply, world {args.nproc} on the CPU (gloo); seconds")
    header = f"{'plan':<22}{'ok':>4}{'wall':>7}{'apply':>7}" + "".join(f"{c:>14}" for c in CHECKS) + f"{'checks':>8}"
    print(header)
    for name, ok, wall, stages, seconds in rows:
        cells = "".join(f"{seconds[c]:>14.2f}" if c in seconds else f"{'-':>14}" for c in CHECKS)
        print(
            f"{name:<22}{'yes' if ok else 'NO':>4}{wall:>7.1f}{stages.get('apply', 0):>7.2f}{cells}{stages.get('checks', 0):>8.2f}"
        )


if __name__ == "__main__":
    main()
