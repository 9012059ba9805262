"""shardlang against torchtitan on torchtitan's own Llama3 1B and Qwen3-MoE 1.2B: one model parallelized by
torchtitan's own `parallelize_llama` (`parallelize_qwen3`), the other by a shardlang plan, both built in one
run and trained alternately after warm-up; median step time, tokens/s, MFU, peak memory and the
collectives of one forward+backward per side.

Configs (`--config`), plans in benchmarks/plans/titan_1b_<config>[_compile].sl:
    fsdp     FSDP2 over every GPU (2 GPUs): torchtitan with dp_shard = world
    tp_sp    tensor parallel 2 with sequence parallelism, no data parallelism (2 GPUs)
    tp_fsdp  dp 2 x tp 2 (4 GPUs); `--tp 4` the plan's `-D tp=4` and torchtitan's TP 4 (8 GPUs: TP 4 x FSDP 2)
`--size 8b`: torchtitan's Llama3 8B instead (benchmarks/titan_8b.py, untied; plans titan_8b_<config>.sl with
torchtitan's units for an untied model: fsdp and tp_fsdp). On one node of 8 (issue 43):
    torchrun --nproc-per-node 8 benchmarks/titan_compare.py [--size 8b] --config fsdp | tp_fsdp [--tp 4]
    torchrun --nproc-per-node 8 benchmarks/titan_compare.py --config ep --ep 4 | 8
and on the MoE (benchmarks/titan_moe.py: 16 layers of 8 experts, top 2), plan benchmarks/plans/titan_moe_ep.sl:
    moe      FSDP2 over every GPU, no expert parallelism (any world; with --plan, e.g. what `shardlang search`
             wrote for the MoE): torchtitan's parallelize_qwen3 with dp_shard = world, its own FSDP
    ep       expert parallel 2 (`--ep N`: N) borrowing the data-parallel ranks, FSDP2 over every GPU (2 GPUs:
             EP 2; 4 GPUs: EP 2 x FSDP 2): torchtitan with dp_shard = world and expert_parallel_degree = 2, its
             standard all-to-all token dispatcher. torchtitan's grouped experts take their rows grouped by expert
             with each expert's count: on torchtitan's side its dispatcher sends them to their expert's rank
             and back around the experts; on shardlang's, the dispatcher stays local and the plan's
             `expert_parallel` on the grouped experts does the sending. The same collectives: per layer an
             all-to-all of the counts and two of the rows each way (shardlang issues the counts' one through
             c10d, torchtitan through the functional collectives: `kinds` counts them as one kind).
`--compile` compiles each block in both: torchtitan's CompileConfig(enable=True, components=["model"])
(TransformerBlock.compile(fullgraph=True)) and the plan's `compile layers.* (fullgraph=true)`.

`--side shardlang|torchtitan` builds and times one side alone, where the two do not fit on the GPUs together
(the 8B on one GPU: benchmarks/search_compare.py --model 8b runs the sides in turn); running out of memory
is then its result.

The numbers: one torchrun invocation per run, three runs in each build order (on H100s or H200s, every
run of a config on the same kind of card); report each order's median ratio and the median of all six:
    for order in shardlang-first titan-first; do for run in 1 2 3; do
        torchrun --nproc-per-node 2 benchmarks/titan_compare.py --config fsdp --order $order
        torchrun --nproc-per-node 2 benchmarks/titan_compare.py --config fsdp --order $order --compile
        torchrun --nproc-per-node 2 benchmarks/titan_compare.py --config tp_sp --order $order
        torchrun --nproc-per-node 2 benchmarks/titan_compare.py --config tp_sp --order $order --compile
        torchrun --nproc-per-node 4 benchmarks/titan_compare.py --config tp_fsdp --order $order
        torchrun --nproc-per-node 4 benchmarks/titan_compare.py --config tp_fsdp --order $order --compile
        torchrun --nproc-per-node 2 benchmarks/titan_compare.py --config ep --order $order   # 4: EP 2 x FSDP 2
    done; done
Dry run on CPU workers (gloo) with the tiny model of the same class (benchmarks/titan_1b.py):
    torchrun --nproc-per-node 2 benchmarks/titan_compare.py --config fsdp --dry-run --steps 2 --warmup 1
(`--config tp_sp`, `--config ep`, `--compile` with the aot_eager backend; 4 processes for tp_fsdp).

The model: benchmarks/titan_1b.py (torchtitan's `llama3_configs["1B"]`, its own SDPA attention on both
sides, weight tying as the 1B has it). torchtitan's side is its own code as its trainer calls it
(torchtitan/trainer.py): ParallelDims.from_config(ParallelismConfig(...)).build_mesh(), the model built on
meta, parallelize_llama(model, parallel_dims=, training=TrainingConfig(...), parallelism=,
compile_config=CompileConfig(...), ac_config=None (no activation checkpointing, on either side, unless
`--titan-ac selective|full` asks for torchtitan's own of every block)), then
`to_empty` on the GPU and `init_weights()` (= init_states). ParallelismConfig's default spmd_backend,
"spmd_types", needs a nightly torch: the plain DTensor backend, "partial_dtensor", is used, set as the
trainer sets it (`set_spmd_backend`). shardlang's side is a second instance of the same config, built on
meta by the plan's `init meta with init_states`. The 1B ties its embedding to lm_head, so torchtitan's
apply_fsdp_to_decoder takes its weight-tying branch: one FSDP unit over tok_embeddings, norm and lm_head
(kept gathered after the forward), each block, the root; the plans lay out exactly those units. Its TP
(set_llama3_sharding_config) splits the tied weight over the vocabulary in both modules: the plans do the
same, the embedding with torchtitan's own masked lookup (titan_1b.vocab_parallel). What differs is how each
runs: torchtitan's partial_dtensor modules compute attention and the feed-forward on DTensors, torch's
ParallelStyles under the plans hand local tensors on; that difference is part of what is measured.

The same work on both sides: the same tokens (batch 4 x sequence 2048 per data-parallel rank), the
shifted-labels causal LM loss of examples/llama.py (`causal_lm_loss`: the logits, bf16 from both, upcast
to fp32 inside), under torch's `loss_parallel()` on both with TP (torchtitan's logits come out as a DTensor
split over the vocabulary; the plans' `lm_head` keeps them so with `loss_parallel`), fused AdamW (lr 1e-4)
on both, bf16 compute with fp32 gradient reduction on both (torchtitan's MixedPrecisionPolicy, the plans'
`mixed_precision(param=bf16, reduce=fp32, cast_forward_inputs=false)`). No gradient clipping on either.
The gradients are not the same: torchtitan's apply_fsdp_to_decoder calls disable_fsdp_gradient_division
(its trainer divides the loss by the global token count instead), so its FSDP reduce-scatters sum the
data-parallel ranks' gradients (NCCL's PreMulSum with factor 1) where shardlang's average them (AVG): with
the same per-rank mean loss, torchtitan's gradients are dp times shardlang's (equal with tp_sp, where dp
is 1). The collectives are the same in kind and number, the reduction op differs; timing is unaffected.
Nor do the initial values match bitwise (each side draws its shards' values under its own layout), except
with --config ep: there torchtitan's model takes shardlang's values (`same_weights`), since a mixture of
experts routes by them and a different routing is a different load on each rank.

Measurement, one process group: both models built (`--order` says which first), `--warmup` steps of
each, then `--steps` steps alternating them (even steps shardlang first, odd steps torchtitan first), each
step timed from a barrier to the GPUs' synchronisation; a step's time is the slowest rank's; the median per
side. Peak memory per side: torch.cuda.max_memory_allocated over its steps minus what was allocated before
the step, the largest over steps and ranks. Collectives: shardlang.verification.comms.Recorder over one
forward+backward of each after warm-up, on every rank (a dispatch mode, which compiled code cannot run
under: with `--compile` that one pass runs the compiled blocks eagerly, torch.compiler.set_stance
("force_eager"), so it counts the collectives the eager program issues). With `--compile`,
torchtitan's apply_compile also sets two global dynamo flags (capture_scalar_outputs,
skip_fwd_side_effects_in_bwd_under_checkpoint) that then hold for both sides' compiles in this process. MFU: torchtitan's own FLOPs per token
(get_nparams_and_flops) x tokens/s over the GPUs' bf16 peak. Rank 0 prints one table and `RESULT {json}`.

Dry run (CPU, gloo), differences from the GPU run, all for torch 2.13 on CPU: torchtitan's ParallelDims
builds its meshes on `torchtitan.tools.utils.device_type`, which is "cuda" on a machine without an
accelerator, so it is pointed at "cpu"; gloo has no PreMulSum, so torchtitan's FSDP modules are set to
`set_force_sum_reduction_for_comms(True)` (a SUM reduce-scatter, the same collectives); AdamW is not
fused; `--compile` uses the aot_eager backend (no kernels compiled) unless `--backend` says otherwise; no
memory is measured (0).

No pp_dp config: torchtitan refuses pipeline parallelism on a model with tied weights
(Decoder.Config.update_from_config: "Weight tying is not supported with Pipeline Parallel") and shardlang
does too (SL214: the tied embedding and lm_head would sit on two stages); the 1B ties them. Untying it
would make a different, larger model (1.5B) than the one the other configs measure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: config: (tensor-parallel degree, world size it needs, or None for any)
CONFIGS = {"fsdp": (1, None), "tp_sp": (2, 2), "tp_fsdp": (2, None), "ep": (1, None), "moe": (1, None)}
#: the expert-parallel degree of --config ep (its plan's `ep=2`): on 2 GPUs EP 2, on 4 EP 2 x FSDP 2
EP = 2
SIDES = ("shardlang", "torchtitan")
#: --titan-ac: torchtitan's activation checkpointing of every block (its ActivationCheckpointingConfig)
TITAN_AC = ("none", "selective", "full")


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), required=True)
    parser.add_argument(
        "--size",
        choices=("1b", "8b"),
        default="1b",
        help="the dense configs' model: torchtitan's Llama3 1B (benchmarks/titan_1b.py) or 8B (titan_8b.py, "
        "untied: its plans benchmarks/plans/titan_8b_<config>.sl lay out torchtitan's units for an untied model)",
    )
    parser.add_argument("--tp", type=int, default=2, help="--config tp_fsdp's tensor-parallel degree (plan's -D tp)")
    parser.add_argument("--ep", type=int, default=EP, help="--config ep's expert-parallel degree (plan's -D ep)")
    parser.add_argument("--compile", action="store_true", help="compile each block in both (per-block torch.compile)")
    parser.add_argument(
        "--compile-loss",
        action="store_true",
        help="with --compile, also compile the loss on both sides: the plan's `compile loss`, torchtitan's "
        "loss component (torch.compile of the loss function, as its BaseLoss does)",
    )
    parser.add_argument(
        "--titan-ac",
        choices=TITAN_AC,
        default="none",
        help="torchtitan's activation checkpointing of every block (its ActivationCheckpointingConfig: "
        "SelectiveAC, its trainer's default, or FullAC); none is the default layout's",
    )
    parser.add_argument(
        "--side",
        choices=("both", "shardlang", "torchtitan"),
        default="both",
        help="build and time one side only, in a process of its own (where the two models do not fit on the "
        "GPUs together, e.g. the 8B on one GPU): no ratio is printed, and running out of memory is a result "
        "(RESULT says `oom`), not a failure",
    )
    parser.add_argument(
        "--titan-eager",
        action="store_true",
        help="with --compile: torchtitan's side stays eager (its default), to time shardlang compiled against it",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after the timing, profile N more steps of each side on rank 0 and print GPU time by kernel kind",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="after the timing, one more step of each side under torch.cuda's memory history: rank 0 prints "
        "what is live at each side's peak, by where it was allocated",
    )
    parser.add_argument(
        "--backend", help="torch.compile backend for --compile (default: inductor; aot_eager in a dry run)"
    )
    parser.add_argument(
        "--order",
        choices=("shardlang-first", "titan-first"),
        default="shardlang-first",
        help="which model is built first (the steps alternate either way)",
    )
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each, alternating")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    parser.add_argument(
        "--accumulation",
        type=int,
        default=1,
        help="split each rank's batch into this many micro-batches, their gradients accumulated before the "
        "optimizer's step (what `shardlang search` writes beside a plan whose batch does not fit at once)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check this script on CPU workers (gloo) with the tiny model"
    )
    parser.add_argument(
        "--plan",
        type=Path,
        help="shardlang's side runs this plan (e.g. what `shardlang search` wrote) instead of the config's; "
        "torchtitan's side is the config's, eager unless --compile",
    )
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = arguments(argv)
    sys.path.insert(0, str(ROOT))
    from benchmarks import titan_1b, titan_8b, titan_moe  # first: torchtitan's stand-ins (CPU, torch 2.11)

    # isort: split
    import torch
    import torch.distributed as dist
    from torchtitan.distributed import utils as titan_utils

    import shardlang
    from benchmarks.gpu_throughput import join
    from shardlang.runtime.apply import apply_plan

    cuda = not args.dry_run
    tiny = args.dry_run
    backend = args.backend or ("inductor" if cuda else "aot_eager")
    device = join(args.dry_run)
    rank, world = dist.get_rank(), dist.get_world_size()
    tp, needs = CONFIGS[args.config]
    tp = args.tp if args.config == "tp_fsdp" else tp
    if (needs is not None and world != needs) or world % tp:
        raise SystemExit(f"--config {args.config} runs on {needs or f'a multiple of {tp}'} processes, not {world}")
    if args.batch % args.accumulation:
        raise SystemExit(f"--batch {args.batch} does not split into --accumulation {args.accumulation} micro-batches")
    if args.config == "ep" and (world % args.ep or world < args.ep):
        raise SystemExit(f"--config ep runs on a multiple of {args.ep} processes, not {world}")
    dp = world // tp
    moe = args.config in ("ep", "moe")
    source = titan_moe if moe else titan_8b if args.size == "8b" else titan_1b  # its config, inputs, loss, FLOPs
    titan_utils.set_spmd_backend("partial_dtensor")  # as torchtitan's trainer does, for its modules' hooks

    config = source.configure(tiny)
    name = f"{source.__name__.rsplit('.', 1)[-1]}_{args.config}{'_compile' if args.compile else ''}{'_loss' if args.compile_loss else ''}.sl"
    if args.plan is None and args.side == "torchtitan" and not (ROOT / "benchmarks" / "plans" / name).exists():
        name = f"{source.__name__.rsplit('.', 1)[-1]}_{args.config}.sl"  # loaded only for its loss: never applied
    if args.plan is None and not (ROOT / "benchmarks" / "plans" / name).exists():
        raise SystemExit(f"no plan benchmarks/plans/{name} for --config {args.config} with these flags")
    params = {"backend": backend} if args.compile and args.plan is None and "_compile" in name else {}
    if args.plan is None:
        params |= {"tp": str(tp)} if args.config == "tp_fsdp" else {"ep": str(args.ep)} if args.config == "ep" else {}
    path = args.plan or ROOT / "benchmarks" / "plans" / name
    name = str(args.plan) if args.plan else f"benchmarks/plans/{name}"
    plan = shardlang.load(path, params, world_size=world)

    def build_shardlang():
        torch.manual_seed(0)
        model = plan.build(config.build)
        return apply_plan(plan, model).model

    def build_titan():
        torch.manual_seed(0)
        return titan(source, config, args, world, tp, backend, device, compiled=args.compile and not args.titan_eager)

    sides = SIDES if args.side == "both" else (args.side,)
    built = {}
    try:
        for side in SIDES if args.order == "shardlang-first" else SIDES[::-1]:
            if side in sides:
                built[side] = build_shardlang() if side == "shardlang" else build_titan()
        measured = measure(args, plan, source, config, built, rank, tp, device, cuda, tiny, backend)
    except torch.OutOfMemoryError as error:
        if args.side == "both":
            raise
        import traceback

        measured = None
        where = " <- ".join(
            f"{f.name} ({Path(f.filename).name}:{f.lineno})"
            for f in traceback.extract_tb(error.__traceback__)[::-1][:6]
        )
        print(f"rank {rank}: {args.side} ran out of memory in {where}: {str(error).splitlines()[0]}", flush=True)
    out_of_memory = [None] * world
    dist.all_gather_object(out_of_memory, measured is None)
    everyone = [None] * world
    dist.all_gather_object(everyone, None if any(out_of_memory) else measured[:3])
    if rank == 0:
        import torchtitan

        result = {
            "config": args.config,
            "plan": name,
            "side": args.side,
            "titan_ac": args.titan_ac,
            "compile": backend if args.compile else None,
            "compile_loss": args.compile_loss,
            "titan_eager": args.titan_eager,
            "order": args.order,
            "world": world,
            "dp": dp,
            "tp": tp,
            "card": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "torchtitan_version": getattr(torchtitan, "__version__", "?"),
            "model": "tiny (dry run)"
            if tiny
            else ("qwen3-moe 1.2B (8 experts, top 2)" if moe else f"llama3 {args.size.upper()}"),
            "batch": args.batch,
            "accumulation": args.accumulation,
            "seq": source.seq(tiny),
            "steps": args.steps,
            "warmup": args.warmup,
        }
        if any(out_of_memory):
            result["oom"] = True
            print(f"{args.side}: out of memory on {sum(out_of_memory)} of {world} ranks")
            print("RESULT " + json.dumps(result))
        else:
            summarize(result, everyone, sides, measured[3], measured[4], source, tiny, dp, world)
    dist.destroy_process_group()


def measure(args, plan, source, config, built, rank, tp, device, cuda, tiny, backend):
    """Warm-up, the collectives of one forward+backward, then the alternating timed steps of the sides
    `built`: (times, peaks, counts, first losses, rank 0's profiles and memory pictures)."""
    import torch

    from benchmarks import titan_moe
    from benchmarks.gpu_throughput import NoMemory, alternate, memory_at_peak, profile, timed_step
    from shardlang.verification.comms import Recorder

    memory = torch.cuda if cuda else NoMemory()
    sides = tuple(side for side in SIDES if side in built)
    if source is titan_moe and len(built) == 2:  # the same weights, so the same routing: the same load on each rank
        same_weights(built["shardlang"], built["torchtitan"])
    optims = {side: torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda) for side, model in built.items()}

    # Each tp group trains on its data-parallel rank's batch: the same tokens for both sides.
    tokens = source.example_input(args.batch, torch.Generator().manual_seed(rank // tp), tiny).to(device)

    def loss_context():
        if tp == 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    # shardlang's loss as its plan says (`compile loss`); torchtitan's as its loss component compiles it.
    titan_loss = source.loss
    if args.compile_loss and not args.titan_eager:
        titan_loss = torch.compile(source.loss, backend=backend)
    losses = {"shardlang": plan.loss(source.loss), "torchtitan": titan_loss}

    first_loss = {}  # each side's loss at its first step (the same weights: the same loss, up to rounding)

    micro = tokens.chunk(args.accumulation)  # the same tokens per step, in --accumulation micro-batches

    def forward_backward(side):
        model = built[side]
        for batch in micro:  # each micro-batch's gradients reduced as it ends, as torchtitan's trainer does
            with loss_context():
                loss = losses[side](model(batch), batch)
                (loss / len(micro)).backward()
            if side not in first_loss:
                first_loss[side] = float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss)

    def step(side):
        forward_backward(side)
        optims[side].step()
        optims[side].zero_grad(set_to_none=True)

    def timed(side) -> tuple[float, int]:
        return timed_step(memory, lambda: step(side))

    for _ in range(args.warmup):
        for side in sides:
            timed(side)
    counts = dict.fromkeys(sides, {})
    # A dispatch mode (the Recorder) cannot run inside compiled code: with --compile the compiled blocks
    # run eagerly for the count (torch.compiler.set_stance("force_eager")), the same modules and hooks.
    # One side alone has nothing to compare its count with, and eager needs more memory than compiled
    # (the 8B on one H200 fits compiled and not eager): no count then.
    # (set_stance sets the stance when called, not when entered: it is called only where entered.)
    compiled = args.compile or bool(plan.compiles) or plan.compile_loss is not None
    for side in sides if len(sides) == 2 else ():
        recorder = Recorder()
        with torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext(), recorder:
            forward_backward(side)
        optims[side].zero_grad(set_to_none=True)
        counts[side] = recorder.counts()
    times, peaks = alternate(sides, args.steps, timed)
    profiles = {side: profile(lambda side=side: timed(side), args.profile) for side in sides} if args.profile else {}
    memories = {side: memory_at_peak(lambda side=side: step(side)) for side in sides} if args.memory else {}
    return times, peaks, counts, first_loss, {"profile": profiles if rank == 0 else {}, "memory": memories}


def summarize(result: dict, everyone: list, sides: tuple, first_loss: dict, pictures: dict, source, tiny, dp, world):
    """Rank 0's RESULT from every rank's (times, peaks, counts): each side's median over the slowest rank's
    steps, tokens/s, MFU and peak; with both sides, the ratios and whether their collectives match."""
    import torch

    from benchmarks.gpu_throughput import PEAK_BF16

    result |= pictures | {"first_loss": first_loss, "counts": everyone[0][2]}
    result["counts_per_rank"] = [e[2] for e in everyone]
    card = next((k for k in PEAK_BF16 if k in result["card"]), None)
    flops = source.flops_per_token(tiny)
    tokens_per_step = result["batch"] * source.seq(tiny) * dp
    for side in sides:
        # The slowest rank sets each step's time.
        per_step = [max(e[0][side][i] for e in everyone) for i in range(result["steps"])]
        median = statistics.median(per_step)
        rate = tokens_per_step / median
        result[side] = {
            "median_s": median,
            "tokens_per_s": rate,
            "mfu": rate * flops / (world * PEAK_BF16[card]) if card else None,
            "peak_bytes": max(e[1][side] for e in everyone),
        }
    if len(sides) == 1:  # one model in this process: rank 0's whole peak over its last step, resident state too
        result[sides[0]]["absolute_peak_bytes"] = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        # cudaMalloc retries: the caching allocator freed its cache and synchronized to find room (near full)
        result[sides[0]]["alloc_retries"] = (
            torch.cuda.memory_stats().get("num_alloc_retries", 0) if torch.cuda.is_available() else 0
        )
        if torch.cuda.is_available():  # what the search's memory budget is calibrated against
            free, total = torch.cuda.mem_get_info()
            result[sides[0]]["reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
            result[sides[0]]["capacity_bytes"] = total
            result[sides[0]]["outside_torch_bytes"] = total - free - torch.cuda.memory_reserved()
    else:
        result["counts_identical"] = all(kinds(e[2]["shardlang"]) == kinds(e[2]["torchtitan"]) for e in everyone)
        result["throughput_ratio"] = result["shardlang"]["tokens_per_s"] / result["torchtitan"]["tokens_per_s"]
        peak_titan = result["torchtitan"]["peak_bytes"]
        result["peak_ratio"] = result["shardlang"]["peak_bytes"] / peak_titan if peak_titan else None
    report(result, sides)


def same_weights(source, target) -> None:
    """`target` takes `source`'s parameters (the same model class, each sharded its own way), by name: each
    gathered whole and laid out as the target's is. Each side initialises its shards under its own layout,
    so their values differ; for a mixture of experts that means a different routing, so a different number
    of rows for each rank's experts: a different load, step time and peak memory, not the
    parallelization's. (Not DCP's state dicts: torchtitan's hooks rename the fused wqkv in them.)"""
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    theirs = dict(target.named_parameters())
    with torch.no_grad():
        for name, param in source.named_parameters():
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            into = theirs[name]
            if isinstance(into, DTensor):
                mesh = into.device_mesh
                spread = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
                into.to_local().copy_(spread.redistribute(mesh, into.placements).to_local())
            else:
                into.copy_(whole)


def kinds(counts: dict[str, int]) -> dict[str, int]:
    """Collective counts by kind: an all-to-all is one kind whichever API issued it (c10d's
    `all_to_all_single`, counted as `alltoall_base_`, or the functional collectives' `all_to_all_single`;
    shardlang exchanges each layer's expert counts with the first, torchtitan with the second)."""
    merged: dict[str, int] = {}
    for op, n in counts.items():
        op = "all_to_all_single" if op == "alltoall_base_" else op
        merged[op] = merged.get(op, 0) + n
    return merged


def titan(source, config, args, world: int, tp: int, backend: str, device, compiled: bool):
    """torchtitan's side, of `source`'s model (benchmarks/titan_1b or titan_moe) built from `config`: its own
    ParallelDims and parallelize_llama (parallelize_qwen3 for the MoE, with expert_parallel_degree EP), as
    its trainer calls them, then `to_empty` on the device and its own initialisation (see the docstring)."""
    import torch
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3.parallelize import parallelize_llama
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    from benchmarks import titan_moe

    moe = source is titan_moe
    ep = args.ep if args.config == "ep" else 1
    if device.type == "cpu":  # dry run: torchtitan's device_type is "cuda" wherever no accelerator is found
        parallel_dims.device_type = "cpu"
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=-1,
        tensor_parallel_degree=tp,
        expert_parallel_degree=ep,
        enable_sequence_parallel=True,
        spmd_backend="partial_dtensor",
    )
    training = TrainingConfig(
        local_batch_size=args.batch,
        seq_len=source.seq(args.dry_run),
        mixed_precision_param="bfloat16",
        mixed_precision_reduce="float32",
    )
    # The loss is compiled (or not) by main(), the same function on both sides: components=["model"] here.
    compile_config = CompileConfig(enable=compiled, components=["model"], backend=backend)
    dims = parallel_dims.ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    with torch.device("meta"):
        model = config.build()
    model = (parallelize_qwen3 if moe else parallelize_llama)(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config={"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[args.titan_ac],
        dump_folder=tempfile.gettempdir(),
        **({"skip_dp": True} if ep > 1 else {}),  # its FSDP with EP needs torch >= 2.12: nested_fsdp() below
    )
    if ep > 1:
        nested_fsdp(model, dims)
    if device.type == "cpu":  # gloo has no PreMulSum (torchtitan's gradient divide factor 1): plain SUM
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def nested_fsdp(model, dims) -> None:
    """FSDP2 on torchtitan's expert-parallel MoE model, as torchtitan 0.3.0's apply_fsdp_to_decoder lays it
    out but for one thing. With EP it gives each block one unit whose experts shard over the `efsdp` mesh
    and the rest over the dp mesh, through per-parameter meshes (fully_shard's `ShardPlacementResult`),
    which torch has from 2.12 on; the GPU machines run 2.11. So each block's experts get their own unit over
    `efsdp`, nested in the block's unit over dp: the layout torchtitan had before per-parameter meshes, and
    the one the plan's `fully_shard on world[dp*ep]` makes. The rest is torchtitan's: bf16 parameters, fp32
    reduction, forward inputs not cast; units over the embedding, each block, and the final norm with the
    output layer (kept gathered after the forward), then the root; no gradient division (its trainer
    divides the loss); and the explicit prefetching it sets when EP is on (its host syncs, one a layer,
    would stall implicit prefetching): each block's forward prefetches the next one's (the embedding the
    first, the last the norm and output layer), each block's backward the previous one's (the output
    layer the last, the first the embedding)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    dp, edp = dims.get_mesh(["fsdp"]), dims.get_mesh(["efsdp"])
    blocks = list(model.layers.values())
    fully_shard(model.tok_embeddings, mesh=dp, mp_policy=policy, reshard_after_forward=True)
    for block in blocks:
        fully_shard(block.moe.routed_experts.inner_experts, mesh=edp, mp_policy=policy, reshard_after_forward=True)
        fully_shard(block, mesh=dp, mp_policy=policy, reshard_after_forward=True)
    fully_shard([model.norm, model.lm_head], mesh=dp, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=dp, mp_policy=policy)
    disable_fsdp_gradient_division(model)
    model.tok_embeddings.set_modules_to_forward_prefetch([blocks[0]])
    for block, following in zip(blocks, [*blocks[1:], None]):
        block.set_modules_to_forward_prefetch([following] if following is not None else [model.norm, model.lm_head])
    model.lm_head.set_modules_to_backward_prefetch([blocks[-1]])
    for block, previous in zip(reversed(blocks), [*reversed(blocks[:-1]), None]):
        block.set_modules_to_backward_prefetch([previous] if previous is not None else [model.tok_embeddings])


def report(result: dict, sides: tuple) -> None:
    from benchmarks.gpu_throughput import print_memory, print_profiles

    compiled = f"compiled per block ({result['compile']})" if result["compile"] else "eager"
    compiled += ", loss compiled" if result.get("compile_loss") else ""
    compiled += " (torchtitan's side eager)" if result.get("titan_eager") else ""
    print(
        f"{result['config']} (dp {result['dp']} x tp {result['tp']}), {compiled}, {result['model']}, batch "
        f"{result['batch']} x {result['seq']} per dp rank, on {result['world']} x {result['card']}, torch "
        f"{result['torch']}, torchtitan {result['torchtitan_version']}; built {result['order']}; median of "
        f"{result['steps']} steps each{', alternating' if len(sides) == 2 else ''}"
    )
    if result.get("titan_ac", "none") != "none" and "torchtitan" in sides:
        print(f"torchtitan's activation checkpointing: {result['titan_ac']}, every block")
    print(f"{'':12}{'step (s)':>10}{'tokens/s':>12}{'MFU':>8}{'peak (GiB)':>12}")
    for side in sides:
        row = result[side]
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
        print(
            f"{side:12}{row['median_s']:>10.4f}{row['tokens_per_s']:>12.0f}{mfu:>8}{row['peak_bytes'] / 2**30:>12.2f}"
        )
    first = result.get("first_loss", {})
    print("loss of the first step (rank 0): " + ", ".join(f"{side} {loss:.5f}" for side, loss in first.items()))
    counts = result["counts"]
    if len(sides) == 1:
        whole = result[sides[0]]["absolute_peak_bytes"] / 2**30
        print(f"rank 0's whole peak over its last step (resident state included): {whole:.2f} GiB")
        print(
            f"rank 0's allocator retries (cache freed to find room) over the run: {result[sides[0]]['alloc_retries']}"
        )
        if "capacity_bytes" in result[sides[0]]:
            row = result[sides[0]]
            print(
                f"rank 0's memory: reserved peak {row['reserved_peak_bytes'] / 2**30:.2f} GiB of "
                f"{row['capacity_bytes'] / 2**30:.2f} GiB; outside torch's allocator "
                f"(CUDA context, NCCL, cuBLAS): {row['outside_torch_bytes'] / 2**30:.2f} GiB"
            )
    else:
        print(f"throughput ratio shardlang / torchtitan: {result['throughput_ratio']:.4f}")
        peak = f"{result['peak_ratio']:.4f}" if result["peak_ratio"] is not None else "- (not measured)"
        print(f"peak memory ratio shardlang / torchtitan: {peak}")
    if len(sides) == 2 and result["counts_identical"]:
        print(f"collectives of one forward+backward: identical on every rank: {kinds(counts['shardlang'])}")
    elif len(sides) == 2:
        print("collectives of one forward+backward: DIFFERENT")
        for rank, seen in enumerate(result["counts_per_rank"]):
            print(f"  rank {rank}: shardlang {seen['shardlang']}")
            print(f"  rank {rank}: torchtitan {seen['torchtitan']}")
    print_profiles(result.get("profile", {}))
    print_memory(result.get("memory", {}))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
