"""lint + lower + apply of the Llama plan on an 80-layer model structure at a simulated world of 1024
(tp 8), next to the hand-written parallelize_module / fully_shard calls, in one process.

    python benchmarks/apply_bench.py [--layers 80] [--world 1024] [--tp 8] [--repeat 3]

The model is built on the meta device and the world is torch's fake process group, so nothing is
allocated and nothing is sent: what is timed is the work on the host, which is what shardlang adds.
Both sides build their own device mesh. Targets: shardlang within 1.2x of hand-written, under 5 s.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import examples.llama as llama  # noqa: E402
import shardlang  # noqa: E402
from shardlang.runtime.apply import apply_plan  # noqa: E402


def build(layers: int):
    with torch.device("meta"):
        return llama.Transformer(vocab=128256, dim=8192, heads=64, layers=layers, hidden=28672, seq=8192)


def handwritten(model, world: int, tp: int) -> None:
    """What a user writes by hand for plans/llama_2d.sl (without checkpointing's effect on timing)."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from benchmarks.handwritten import parallelize_llama

    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_llama(model, mesh["tp"])
    for block in model.layers:
        checkpoint(block)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=True)
    fully_shard(model.output, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--world", type=int, default=1024)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)

    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=args.world, store=FakeStore())
    plan_path = ROOT / "plans" / "llama_2d.sl"
    # In a simulated world apply places every tensor but allocates nothing (no `init meta`
    # materialisation), like the hand-written calls above.
    text = plan_path.read_text()

    rows = {"hand": [], "shardlang": [], "parse": [], "lint": [], "run": []}
    for _ in range(args.repeat):
        model = build(args.layers)
        start = time.perf_counter()
        handwritten(model, args.world, args.tp)
        rows["hand"].append(time.perf_counter() - start)

        model = build(args.layers)
        start = time.perf_counter()
        plan = shardlang.loads(text, params={"tp": args.tp}, name=str(plan_path))
        parsed = time.perf_counter()
        applied = apply_plan(plan, model)
        done = time.perf_counter()
        rows["shardlang"].append(done - start)
        rows["parse"].append(parsed - start)
        rows["run"].append(done - parsed)
        assert applied.linted.ok
    steps = len(applied.program.steps)
    dist.destroy_process_group()

    hand, ours = min(rows["hand"]), min(rows["shardlang"])
    print(
        f"Llama plan, {args.layers} layers on meta, simulated world {args.world} (dp {args.world // args.tp} x tp {args.tp}); "
        f"torch {torch.__version__}; best of {args.repeat}"
    )
    print(f"{'':34}{'seconds':>10}")
    print(f"{'hand-written TP + checkpoint + FSDP':34}{hand:>10.3f}")
    print(f"{'shardlang: parse + check':34}{min(rows['parse']):>10.3f}")
    print(f"{'shardlang: lint + lower + apply':34}{min(rows['run']):>10.3f}  ({steps} program steps)")
    print(f"{'shardlang: whole pipeline':34}{ours:>10.3f}")
    print(f"{'ratio shardlang / hand-written':34}{ours / hand:>10.2f}x")


if __name__ == "__main__":
    main()
