"""Every plan in plans/ under `shardlang apply --device cuda` with all five checks, at 4 GPUs and at 2
where the plan fits, next to the same command on the CPU (gloo) where reports are given.

    python benchmarks/gpu_plans.py [--nproc 4 2] [--cpu-reports DIR]

Prints one table: plan, GPUs, result, the worst gradient error, collective counts, and where the
counts or placements differ from the CPU run's.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import shardlang

ROOT = Path(__file__).resolve().parent.parent
CHECKS = "gradients,module_states,init_device,placements,comms"


def apply(plan: Path, model: str, nproc: int, device: str) -> tuple[dict | None, float, str]:
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardlang",
            "apply",
            str(plan.relative_to(ROOT)),
            model,
            "--device",
            device,
            "--nproc",
            str(nproc),
            "--verify",
            CHECKS,
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    try:
        return json.loads(done.stdout), wall, done.stderr[-800:]
    except json.JSONDecodeError:
        return None, wall, (done.stdout + done.stderr)[-800:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cpu-reports", metavar="DIR", help="JSON reports of the same runs on the CPU, to compare")
    parser.add_argument("--save", metavar="DIR", help="write each JSON report there")
    args = parser.parse_args()
    rows = []
    for plan in sorted((ROOT / "plans").glob("*.sl")):
        model = re.search(r"Model: (\S+\.py)", plan.read_text()).group(1)
        for nproc in args.nproc:
            if shardlang.load(plan).with_world(nproc):
                continue
            report, wall, tail = apply(plan, model, nproc, args.device)
            if args.save and report is not None:
                Path(args.save).mkdir(parents=True, exist_ok=True)
                (Path(args.save) / f"{plan.stem}-{nproc}.json").write_text(json.dumps(report))
            other = None
            if args.cpu_reports and (Path(args.cpu_reports) / f"{plan.stem}-{nproc}.json").exists():
                other = json.loads((Path(args.cpu_reports) / f"{plan.stem}-{nproc}.json").read_text())
            rows.append((plan.stem, nproc, report, wall, tail, other))

    print(f"shardlang apply --device {args.device} --verify {CHECKS}")
    print(f"{'plan':22}{'n':>3}{'ok':>5}{'wall':>7}  {'gradients worst':>16}  comms (vs cpu)")
    for name, nproc, report, wall, tail, other in rows:
        if report is None:
            print(f"{name:22}{nproc:>3}{'ERR':>5}{wall:>6.1f}s  {tail!r}")
            continue
        checks = {c["check"]: c for c in report["checks"]}
        worst = checks.get("gradients", {}).get("data", {}).get("worst_error", float("nan"))
        counts = checks.get("comms", {}).get("data", {}).get("counts", {})
        note = ""
        if other is not None:
            cpu = {c["check"]: c for c in other["checks"]}
            cpu_counts = cpu.get("comms", {}).get("data", {}).get("counts", {})
            note = "same as cpu" if cpu_counts == counts else f"cpu {cpu_counts}"
        failed = [f"{c}: {checks[c]['message']}" for c in checks if not checks[c]["ok"]]
        print(f"{name:22}{nproc:>3}{'yes' if report['ok'] else 'NO':>5}{wall:>6.1f}s  {worst:>16.2e}  {counts} {note}")
        for line in failed + [d["message"] for d in report["diagnostics"] if d["severity"] == "error"][:3]:
            print(f"{'':30}{line[:300]}")


if __name__ == "__main__":
    main()
