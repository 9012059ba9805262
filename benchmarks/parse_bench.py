"""Front-end speed: parse and statically check a generated plan of 10,000 rules, next to reading the file.

    python benchmarks/parse_bench.py [--rules 10000] [--repeat 5]

Two generated plans: `llama` writes the docs/language.md §2 block rules out for every layer index (what a
large real plan looks like), `heavy` gives every rule a long argument list (a stress case).
Prints one table; the target is parse + check under 1 s for the 10,000-rule llama plan.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import shardlang
from shardlang.frontend.parse import _lark

LLAMA_BODY = [
    ("attention_norm", "sequence_parallel"),
    ("attention", "prepare_input(input=(shard(1), _), desired=(replicate, _))"),
    ("attention.{wq,wk,wv}", "colwise"),
    ("attention.wo", "rowwise(output=shard(1))"),
    ("ffn_norm", "sequence_parallel"),
    ("feed_forward", "prepare_input(input=shard(1), desired=replicate)"),
    ("feed_forward.{w1,w3}", "colwise"),
    ("feed_forward.w2", "rowwise(output=shard(1))"),
]
HEAVY_STYLE = "colwise(input=shard(1), output=replicate, local_output=false)"


def generate(kind: str, rules: int) -> str:
    lines = ["shardlang 1", "param tp = 8", "mesh world = auto[dp=auto, tp=$tp]", "parallelize on world.tp {"]
    for i in range(rules):
        if kind == "llama":
            pattern, style = LLAMA_BODY[i % len(LLAMA_BODY)]
            lines.append(f"    layers.{i // len(LLAMA_BODY)}.{pattern} : {style}")
        else:
            lines.append(f"    blocks.{i}.{{wq,wk,wv}}.proj : {HEAVY_STYLE}")
    lines += [
        "}",
        "fully_shard on world.dp {",
        "    each layers.*",
        "    mixed_precision(param=bf16, reduce=fp32)",
        "}",
    ]
    return "\n".join(lines) + "\n"


def best(fn, repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    start = time.perf_counter()
    _lark()
    grammar_s = time.perf_counter() - start
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("llama", "heavy"):
            path = Path(tmp) / f"{kind}.sl"
            path.write_text(generate(kind, args.rules))
            read_min, _ = best(path.read_bytes, args.repeat)
            plan_min, plan_med = best(lambda path=path: shardlang.load(path, world_size=64), args.repeat)
            rules = sum(len(b.rules) for b in shardlang.load(path).parallelize)
            rows.append((kind, rules, path.stat().st_size, read_min, plan_min, plan_med))

    print(
        f"shardlang front end, python {sys.version.split()[0]}; grammar build (once per process): {grammar_s * 1e3:.0f} ms"
    )
    print(f"{'plan':<8}{'rules':>8}{'bytes':>10}{'read file':>12}{'parse+check':>14}{'median':>10}{'per rule':>11}")
    for kind, rules, size, read_s, plan_s, plan_med in rows:
        print(
            f"{kind:<8}{rules:>8}{size:>10}{read_s * 1e3:>10.2f}ms{plan_s:>13.3f}s{plan_med:>9.3f}s{plan_s / rules * 1e6:>9.1f}us"
        )


if __name__ == "__main__":
    main()
