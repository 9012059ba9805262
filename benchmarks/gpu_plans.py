"""Every plan in plans/ (and plans/hf/ where transformers is installed) under `shardlang apply --device
cuda` with its own checks and comms, at 4 GPUs and at 2 where the plan fits, with each optimizer asked for, next
to the same command on the CPU (gloo) where reports are given.

    python benchmarks/gpu_plans.py [--nproc 4 2] [--optimizers adam adamw] [--cpu-reports DIR]
        [--only 'hf/*'] [--timeout 300]

Prints one table: plan, GPUs, result, the worst gradient error, collective counts, and where the
counts or placements differ from the CPU run's.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import shardlang

ROOT = Path(__file__).resolve().parent.parent


def apply(
    plan: Path, model: str, nproc: int, device: str, optimizer: str, timeout: float
) -> tuple[dict | None, float, str]:
    """The plan's own checks plus comms (to compare the collectives with the CPU's), under `optimizer`; a run
    past `timeout` seconds is killed and reported as such."""
    checks = [c.name for c in shardlang.load(plan).checks]
    checks += [] if "comms" in checks else ["comms"]
    start = time.perf_counter()
    command = [
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
        ",".join(checks),
        "--optimizer",
        optimizer,
        "--json",
    ]
    # A session of its own, so that a run past its time is killed with its workers.
    run = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        run.communicate()
        return None, time.perf_counter() - start, f"killed after {timeout:.0f} s"
    wall = time.perf_counter() - start
    try:
        return json.loads(stdout), wall, stderr[-800:]
    except json.JSONDecodeError:
        return None, wall, (stdout + stderr)[-800:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--optimizers", nargs="+", default=["adam", "adamw"], choices=["sgd", "adam", "adamw"])
    parser.add_argument("--cpu-reports", metavar="DIR", help="JSON reports of the same runs on the CPU, to compare")
    parser.add_argument("--save", metavar="DIR", help="write each JSON report there")
    parser.add_argument("--only", metavar="GLOB", help="the plans whose name (hf/gpt2, llama_2d) matches")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one apply may take (default 300)")
    args = parser.parse_args()
    rows = []
    plans = sorted((ROOT / "plans").glob("*.sl"))
    if importlib.util.find_spec("transformers") is not None:
        plans += sorted((ROOT / "plans" / "hf").glob("*.sl"))
    for plan in plans:
        model = re.search(r"Model: (\S+\.py)", plan.read_text()).group(1)
        name = plan.stem if plan.parent.name == "plans" else f"hf/{plan.stem}"
        if args.only and not fnmatch.fnmatch(name, args.only):
            continue
        for nproc in args.nproc:
            if shardlang.load(plan).with_world(nproc):
                continue
            for optimizer in args.optimizers:
                report, wall, tail = apply(plan, model, nproc, args.device, optimizer, args.timeout)
                key = f"{name.replace('/', '-')}-{nproc}-{optimizer}"
                if args.save and report is not None:
                    Path(args.save).mkdir(parents=True, exist_ok=True)
                    (Path(args.save) / f"{key}.json").write_text(json.dumps(report))
                other = None
                if args.cpu_reports and (Path(args.cpu_reports) / f"{key}.json").exists():
                    other = json.loads((Path(args.cpu_reports) / f"{key}.json").read_text())
                rows.append((f"{name} {optimizer}", nproc, report, wall, tail, other))

    print(f"shardlang apply --device {args.device} --verify <the plan's checks>,comms --optimizer <each>")
    print(f"{'plan, optimizer':30}{'n':>3}{'ok':>5}{'wall':>7}  {'summary':24}{'worst/allowed':>14}  comms (vs cpu)")
    for name, nproc, report, wall, tail, other in rows:
        if report is None:
            print(f"{name:30}{nproc:>3}{'ERR':>5}{wall:>6.1f}s  {tail!r}")
            continue
        checks = {c["check"]: c for c in report["checks"]}
        worst = checks.get("gradients", {}).get("data", {}).get("worst_error", float("nan"))
        counts = checks.get("comms", {}).get("data", {}).get("counts", {})
        note = ""
        if other is not None:
            cpu = {c["check"]: c for c in other["checks"]}
            cpu_counts = cpu.get("comms", {}).get("data", {}).get("counts", {})
            note = "same as cpu" if cpu_counts == counts else f"cpu {cpu_counts}"
        failed = [f"{c}: {checks[c]['message']}" for c in checks if checks[c]["status"] == "fail"]
        ok = "yes" if report["ok"] else "NO"
        print(f"{name:30}{nproc:>3}{ok:>5}{wall:>6.1f}s  {report['summary']:24}{worst:>14.2f}  {counts} {note}")
        for line in failed + [d["message"] for d in report["diagnostics"] if d["severity"] == "error"][:3]:
            print(f"{'':30}{line[:300]}")


if __name__ == "__main__":
    main()
