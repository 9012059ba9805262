"""Two versions of shardlang's expert parallelism timed against each other on ep_compare.py's 1.2B Mixtral:
the installed one (`shardlang.runtime.experts`) and the `runtime/experts.py` of another tree (`--before`),
each applying `benchmarks/plans/mixtral_ep.sl` to its own copy of the model, trained alternately.

    cd AFTER_TREE && torchrun --nproc-per-node 2 benchmarks/ep_versions.py --before ../BEFORE_TREE
    torchrun --nproc-per-node 2 benchmarks/ep_versions.py --before BEFORE_TREE --dry-run --steps 2   # CPU

Only the experts module differs between the sides: the before one is loaded from its file into the installed
package (its relative imports resolve there) and stands in for `shardlang.runtime.experts.ExpertParallel`
while its side's plan is applied. Both sides start from the same weights and the same tokens, shared by
the ranks (4 x 1024, ep over every GPU); bf16, fused AdamW. `--rounds` times `--steps` alternating steps
(even steps `after` first) after `--warmup` of each; a step's time is the slowest rank's; per round, each
side's median; the table gives each round and the median of the rounds, with each side's collectives of
one forward+backward.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("after", "before")


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the tree whose shardlang/runtime/experts.py is `before`")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dry-run", action="store_true", help="CPU workers (gloo) and a tiny model")
    return parser.parse_args(argv)


def load_before(tree: str):
    """The `before` tree's runtime/experts.py, as a module of the installed package."""
    path = Path(tree) / "shardlang" / "runtime" / "experts.py"
    spec = importlib.util.spec_from_file_location("shardlang.runtime._experts_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def apply_with(style, plan, model):
    """apply_plan(plan, model) with `style` standing in for the installed ExpertParallel."""
    from shardlang.runtime import experts
    from shardlang.runtime.apply import apply_plan

    kept = experts.ExpertParallel
    experts.ExpertParallel = style
    try:
        return apply_plan(plan, model).model
    finally:
        experts.ExpertParallel = kept


def main(argv=None) -> None:
    args = arguments(argv)
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    from transformers import MixtralForCausalLM

    import shardlang
    from benchmarks.ep_compare import configure
    from benchmarks.gpu_throughput import NoMemory, alternate, join, timed_step
    from shardlang.runtime import experts
    from shardlang.verification.comms import Recorder

    cuda = not args.dry_run
    device = join(args.dry_run)
    memory = torch.cuda if cuda else NoMemory()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = configure(args.dry_run)
    seq = 32 if args.dry_run else args.seq
    plan = shardlang.load(ROOT / "benchmarks" / "plans" / "mixtral_ep.sl", world_size=world)
    styles = {"after": experts.ExpertParallel, "before": load_before(args.before).ExpertParallel}

    def build(side):
        torch.manual_seed(0)
        with device:
            model = MixtralForCausalLM(config).to(torch.bfloat16)
        return apply_with(styles[side], plan, model)

    built = {side: build(side) for side in SIDES}

    def groups(model):  # fused AdamW takes no mix of DTensors and plain tensors in one group
        from torch.distributed.tensor import DTensor

        params = list(model.parameters())
        split = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
        return [{"params": group} for group in split if group]

    optims = {side: torch.optim.AdamW(groups(m), lr=1e-4, fused=cuda) for side, m in built.items()}
    tokens = torch.randint(0, config.vocab_size, (args.batch, seq), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)

    def forward_backward(side):
        logits = built[side](input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        return loss.item()

    def step(side):
        forward_backward(side)
        optims[side].step()
        optims[side].zero_grad(set_to_none=True)

    first, counts = {}, {}
    for side in SIDES:
        recorder = Recorder()
        with recorder:
            first[side] = forward_backward(side)
        optims[side].zero_grad(set_to_none=True)
        counts[side] = recorder.counts()
    for _ in range(args.warmup):
        for side in SIDES:
            timed_step(memory, lambda side=side: step(side))
    rounds = [
        alternate(SIDES, args.steps, lambda side: timed_step(memory, lambda: step(side))) for _ in range(args.rounds)
    ]
    everyone = [None] * world
    dist.all_gather_object(everyone, rounds)
    if rank == 0:
        card = torch.cuda.get_device_name() if cuda else "cpu"
        report(everyone, args, seq, first, counts, card, torch.__version__)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads at exit can abort the process (see ep_compare.py)


def report(everyone, args, seq, first, counts, card, version) -> None:
    """Each round's median step of each side (the slowest rank's per step), the median of the rounds, and
    RESULT as JSON."""
    rows = []
    for r in range(args.rounds):
        medians = {}
        for side in SIDES:
            slowest = [max(ranks[r][0][side][i] for ranks in everyone) for i in range(args.steps)]
            medians[side] = statistics.median(slowest)
        peaks = {side: max(ranks[r][1][side] for ranks in everyone) for side in SIDES}
        rows.append({"median_s": medians, "peak_bytes": peaks})
    result = {"card": card, "torch": version, "world": len(everyone), "tokens_per_step": args.batch * seq}
    result.update(steps=args.steps, rounds=rows, first_loss=first, counts=counts)
    result["median_s"] = {s: statistics.median(row["median_s"][s] for row in rows) for s in SIDES}
    print("RESULT " + json.dumps(result), flush=True)
    print(f"{len(everyone)} x {card}, torch {version}; first loss {first}")
    print(f"{'round':<7} {'after':>10} {'before':>10} {'before / after':>15} {'peak after / before':>20}")
    for r, row in enumerate(rows, 1):
        m, p = row["median_s"], row["peak_bytes"]
        print(
            f"{r:<7} {m['after'] * 1e3:>7.1f} ms {m['before'] * 1e3:>7.1f} ms {m['before'] / m['after']:>15.4f} "
            f"{p['after'] / max(1, p['before']):>20.4f}"
        )
    m = result["median_s"]
    print(f"{'median':<7} {m['after'] * 1e3:>7.1f} ms {m['before'] * 1e3:>7.1f} ms {m['before'] / m['after']:>15.4f}")
    for side in SIDES:
        print(f"{side} collectives per forward+backward: {counts[side]}")


if __name__ == "__main__":
    main()
