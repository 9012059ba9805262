"""The sweep: every selected family and mode not yet in the results file, one at a time, each command in its
own process; and the table of the results. `python -m benchmarks.zoo --help`."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks.zoo.build import ROOT, Family, applies, families, probe, write_model_file
from benchmarks.zoo.plant import plant
from benchmarks.zoo.verdicts import apply_verdict, init_verdict, judged, lint_verdict, normalised, shardlang

CACHE = ROOT / "benchmarks" / ".zoo"
RESULTS = ROOT / "benchmarks" / "zoo_results.jsonl"

#: The sweep's modes: init's flags, and which families they apply to (see `applies`).
MODES = {"plain": (), "tp": ("--tp", "2"), "ep": ("--ep", "2"), "cp": ("--cp", "2"), "pp": ("--pp", "2")}


def run(fam: Family, mode: str, timeout: float, dp: int | None = None, device: str = "cpu") -> dict:
    """init, lint and apply of one family's starter plan in one mode, each in its own process; `dp`: init's
    --dp (None: its own, 2 where the plan says auto); `device`: apply's (cuda: NCCL, one GPU a rank)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / ".gitignore").write_text("*\n")  # generated files, never committed
    model = write_model_file(fam.name, CACHE / f"{fam.name.replace('-', '_')}.py")
    plan = CACHE / f"{model.stem}.{mode}.sl"
    plan.unlink(missing_ok=True)
    given = ["--dp", str(dp)] if dp else []
    ran = shardlang(["init", str(model), *MODES[mode], *given, "--no-check", "-o", str(plan)], timeout)
    record = {"init": init_verdict(ran)}
    if mode == "pp" and plan.exists():  # a pipeline, or the comment that says why none
        record["pipelined"] = pipelined(plan.read_text())
    if not plan.exists():
        record["crash"] = ran.crashed  # exit 2 with a diagnostic and no traceback is init refusing, not a crash
        record["tail"] = ran.tail()
        return record
    world = str(record["init"]["world"] or (2 if mode == "plain" else 4))
    ran_lint = shardlang(["lint", str(plan), str(model), "--world", world, "--format", "json"], timeout)
    ran_apply = shardlang(
        [
            "apply",
            str(plan),
            str(model),
            "--nproc",
            world,
            "--device",
            device,
            "--json",
            "--timeout",
            str(int(timeout)),
        ],
        timeout + 30,
    )
    record |= {"world": int(world), "lint": lint_verdict(ran_lint), "apply": apply_verdict(ran_apply)}
    record["crash"] = any(r.crashed for r in (ran, ran_lint, ran_apply))
    if record["crash"] or record["apply"]["verdict"] != "pass":
        record["tail"] = next((r.tail() for r in (ran, ran_lint, ran_apply) if r.crashed), ran_apply.tail())
    elif mode == "tp":  # a plan that passed: its planted mistake must fail, named
        record["planted"] = plant(plan, model, world, timeout, shardlang)
    return record


def pipelined(text: str) -> bool | str:
    """True where the plan has a pipeline, else why init wrote none (its comment, names and numbers blanked)."""
    if "\npipeline on " in text:
        return True
    comment = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    why = re.search(r"--pp \d+ asked for, but (.*?): no pipeline", comment)
    return normalised(why.group(1)) if why else "no pipeline, and no comment saying why"


def done_keys(path: Path) -> set[tuple[str, str]]:
    if not path.exists():
        return set()
    return {key(r) for r in map(json.loads, path.read_text().splitlines()) if r}


def key(record: dict) -> tuple[str, str]:
    """A record's (family, mode), the mode named with its device where that is not the CPU."""
    device = record.get("device", "cpu")
    return record["family"], record["mode"] if device == "cpu" else f"{record['mode']} on {device}"


def selected(args: argparse.Namespace) -> list[Family]:
    found = [f for f in families() if not args.only or f.name in args.only]
    index, count = map(int, args.shard.split("/"))
    return found[index::count]


def sweep(args: argparse.Namespace) -> None:
    """Each selected family not yet in the results file, one (family, mode) at a time, a line each."""
    done, chosen = done_keys(args.results), selected(args)
    for number, fam in enumerate(chosen, 1):
        todo = [m for m in args.mode if key({"family": fam.name, "mode": m, "device": args.device}) not in done]
        todo = [m for m in todo if applies(fam, m)]
        if not todo:
            continue
        start = time.perf_counter()
        why = probe(fam)
        for mode in todo:
            record = {"family": fam.name, "kind": fam.kind, "model_class": fam.model_class, "mode": mode}
            record["device"] = args.device
            if why is not None:
                record |= {"built": why}
            else:
                record |= {"built": True, **run(fam, mode, args.timeout, args.dp, args.device)}
            record |= judged(record) | {"seconds": round(time.perf_counter() - start, 1)}
            with args.results.open("a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")
            said = record["class"] or record.get("built") if record["outcome"] != "pass" else ""
            print(
                f"[{number}/{len(chosen)}] {fam.name} {mode}: {record['outcome']} ({record['agreement']}, "
                f"{record['seconds']:.0f} s) {said or ''}",
                flush=True,
            )
            start = time.perf_counter()


def table(path: Path) -> str:
    """The summary: outcomes and lint-vs-apply by mode, then the failures grouped by class with examples."""
    newest = {}
    for line in path.read_text().splitlines():  # the newest record of each (family, mode): a re-run after a fix
        if line.strip():
            record = json.loads(line)
            newest[key(record)] = record
    records = [r | judged(r) for r in newest.values()]  # classes as this version of the sweep names them
    lines = [
        f"{len({r['family'] for r in records})} families tried, "
        f"{len({r['family'] for r in records if r.get('built') is True})} built",
        "",
    ]
    lines += [
        "| mode | tried | built | pass | fail | crash | timed out | init refused | lint agrees | false alarm | miss "
        "| lint crash |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in [*MODES, *(f"{m} on cuda" for m in MODES)]:
        rows = [r for r in records if key(r)[1] == mode]
        if rows:
            count = _counter(rows)
            built = sum(r.get("built") is True for r in rows)
            lines.append(
                f"| {mode} | {len(rows)} | {built} | {count('outcome', 'pass')} | {count('outcome', 'fail')} "
                f"| {count('outcome', 'crash')} | {count('outcome', 'timed out')} | {count('outcome', 'init refused')} "
                f"| {count('agreement', 'agree')} | "
                f"{count('agreement', 'false alarm')} | {count('agreement', 'miss')} | "
                f"{count('agreement', 'lint crash')} |"
            )
    cuts = [r["pipelined"] for r in records if "pipelined" in r]
    if cuts:
        whys = Counter(why for why in cuts if why is not True)
        lines += [
            "",
            f"pp: {cuts.count(True)} of {len(cuts)} starters pipelined; no pipeline, init saying why: "
            + ("; ".join(f"{n} x {why}" for why, n in whys.most_common()) or "none"),
        ]
    plants = {key(r): r["planted"] for r in records if r.get("planted")}
    if plants:
        missed = [" ".join(k) for k, p in plants.items() if not p["caught"]]
        lines += [
            "",
            f"planted mistakes (tp: the first rowwise rule in the blocks removed): {len(plants) - len(missed)} of "
            f"{len(plants)} failed in lint and in apply, naming the module"
            + (f"; not: {', '.join(missed)}" if missed else ""),
        ]
    lines += ["", "| class | mode | outcome / lint vs apply | families |", "|---|---|---|---|"]
    classes: dict[tuple, list[str]] = {}
    for r in records:
        if r.get("class"):
            classes.setdefault((r["class"], key(r)[1], f"{r['outcome']} / {r['agreement']}"), []).append(r["family"])
    for (name, mode, outcome), fams in sorted(classes.items(), key=lambda item: -len(item[1])):
        shown = ", ".join(fams[:4]) + (f" (+{len(fams) - 4})" if len(fams) > 4 else "")
        lines.append(f"| {name.replace('|', '/')} | {mode} | {outcome} | {len(fams)}: {shown} |")
    unbuilt = {}
    for r in records:
        if r.get("built") is not True:
            unbuilt.setdefault(normalised(r["built"])[:80], []).append(r["family"])
    lines += ["", "| not built: why | families |", "|---|---|"]
    for why, fams in sorted(unbuilt.items(), key=lambda item: -len(item[1])):
        lines.append(
            f"| {why.replace('|', '/')} | {len(fams)}: {', '.join(fams[:4])}{' ...' if len(fams) > 4 else ''} |"
        )
    return "\n".join(lines)


def built(args: argparse.Namespace) -> None:
    """Only the build and the unsharded step of every selected family (no shardlang command): which build,
    and why the others do not, grouped."""
    why: dict[str, list[str]] = {}
    for fam in selected(args):
        why.setdefault(normalised(probe(fam) or "built")[:80], []).append(fam.name)
    print(f"{len(why.get('built', []))} of {sum(map(len, why.values()))} families built")
    for reason, fams in sorted(why.items(), key=lambda item: -len(item[1])):
        if reason != "built":
            print(f"{len(fams):4d} {reason}: {', '.join(fams)}")


def _counter(rows: list[dict]):
    """How many of `rows` have `key` equal to `value`."""
    return lambda key, value: sum(r[key] == value for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description="The zoo (issue 41): every transformers family, swept")
    parser.add_argument("--mode", nargs="*", choices=tuple(MODES), default=["plain"])
    parser.add_argument("--only", nargs="*", help="families (model_type names) to run")
    parser.add_argument("--shard", default="0/1", help="I/N: every Nth family from the Ith (0-based)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per command")
    parser.add_argument("--dp", type=int, help="init's --dp (1: the tp, ep, cp or pp ranks alone, world 2 at size 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="apply's (cuda: NCCL, a GPU a rank)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--table", action="store_true", help="print the summary of the results file and exit")
    parser.add_argument("--built", action="store_true", help="only build each family and run its unsharded step")
    args = parser.parse_args()
    if args.table:
        print(table(args.results))
        return
    sys.path.insert(0, str(ROOT))
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    built(args) if args.built else sweep(args)


if __name__ == "__main__":
    main()
