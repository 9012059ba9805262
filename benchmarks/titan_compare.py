"""shardlang against torchtitan on torchtitan's own Llama3 1B: one model parallelized by torchtitan's own
`parallelize_llama`, the other by a shardlang plan, both built in one run and trained alternately after
warm-up; median step time, tokens/s, MFU, peak memory and the collectives of one forward+backward per side.

Configs (`--config`), plans in benchmarks/plans/titan_1b_<config>[_compile].sl:
    fsdp     FSDP2 over every GPU (2 GPUs): torchtitan with dp_shard = world
    tp_sp    tensor parallel 2 with sequence parallelism, no data parallelism (2 GPUs)
    tp_fsdp  dp 2 x tp 2 (4 GPUs)
`--compile` compiles each block in both: torchtitan's CompileConfig(enable=True, components=["model"])
(TransformerBlock.compile(fullgraph=True)) and the plan's `compile layers.* (fullgraph=true)`.

The numbers: one torchrun invocation per run, three runs in each build order (on H100s or H200s, every
run of a config on the same kind of card); report each order's median ratio and the median of all six:
    for order in shardlang-first titan-first; do for run in 1 2 3; do
        torchrun --nproc-per-node 2 benchmarks/titan_compare.py --config fsdp --order $order
        torchrun --nproc-per-node 2 benchmarks/titan_compare.py --config fsdp --order $order --compile
        torchrun --nproc-per-node 2 benchmarks/titan_compare.py --config tp_sp --order $order
        torchrun --nproc-per-node 2 benchmarks/titan_compare.py --config tp_sp --order $order --compile
        torchrun --nproc-per-node 4 benchmarks/titan_compare.py --config tp_fsdp --order $order
        torchrun --nproc-per-node 4 benchmarks/titan_compare.py --config tp_fsdp --order $order --compile
    done; done
Dry run on CPU workers (gloo) with the tiny model of the same class (benchmarks/titan_1b.py):
    torchrun --nproc-per-node 2 benchmarks/titan_compare.py --config fsdp --dry-run --steps 2 --warmup 1
(`--config tp_sp`, `--compile` with the aot_eager backend; 4 processes for tp_fsdp).

The model: benchmarks/titan_1b.py (torchtitan's `llama3_configs["1B"]`, its own SDPA attention on both
sides, weight tying as the 1B has it). torchtitan's side is its own code as its trainer calls it
(torchtitan/trainer.py): ParallelDims.from_config(ParallelismConfig(...)).build_mesh(), the model built on
meta, parallelize_llama(model, parallel_dims=, training=TrainingConfig(...), parallelism=,
compile_config=CompileConfig(...), ac_config=None (no activation checkpointing, on either side)), then
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
Nor do the initial values match bitwise (each side draws its shards' values under its own layout).

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
CONFIGS = {"fsdp": (1, None), "tp_sp": (2, 2), "tp_fsdp": (2, None)}
SIDES = ("shardlang", "torchtitan")


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), required=True)
    parser.add_argument("--compile", action="store_true", help="compile each block in both (per-block torch.compile)")
    parser.add_argument(
        "--compile-loss",
        action="store_true",
        help="with --compile, also compile the loss on both sides: the plan's `compile loss`, torchtitan's "
        "loss component (torch.compile of the loss function, as its BaseLoss does)",
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
        "--dry-run", action="store_true", help="check this script on CPU workers (gloo) with the tiny model"
    )
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = arguments(argv)
    sys.path.insert(0, str(ROOT))
    from benchmarks import titan_1b  # first: torchtitan's imports need its stand-ins on CPU and torch 2.11

    # isort: split
    import torch
    import torch.distributed as dist
    from torchtitan.distributed import utils as titan_utils

    import shardlang
    from benchmarks.gpu_throughput import PEAK_BF16, NoMemory, alternate, join, profile, timed_step
    from shardlang.runtime.apply import apply_plan
    from shardlang.verification.comms import Recorder

    cuda = not args.dry_run
    tiny = args.dry_run
    backend = args.backend or ("inductor" if cuda else "aot_eager")
    device = join(args.dry_run)
    memory = torch.cuda if cuda else NoMemory()
    rank, world = dist.get_rank(), dist.get_world_size()
    tp, needs = CONFIGS[args.config]
    if (needs is not None and world != needs) or world % tp:
        raise SystemExit(f"--config {args.config} runs on {needs or f'a multiple of {tp}'} processes, not {world}")
    dp = world // tp
    titan_utils.set_spmd_backend("partial_dtensor")  # as torchtitan's trainer does, for its modules' hooks

    config = titan_1b.configure(tiny)
    name = f"titan_1b_{args.config}{'_compile' if args.compile else ''}{'_loss' if args.compile_loss else ''}.sl"
    if not (ROOT / "benchmarks" / "plans" / name).exists():
        raise SystemExit(f"no plan benchmarks/plans/{name} for --config {args.config} with these flags")
    params = {"backend": backend} if args.compile else None
    plan = shardlang.load(ROOT / "benchmarks" / "plans" / name, params, world_size=world)

    def build_shardlang():
        torch.manual_seed(0)
        model = plan.build(config.build)
        return apply_plan(plan, model).model

    def build_titan():
        torch.manual_seed(0)
        return titan(config, args, world, tp, backend, device, compiled=args.compile and not args.titan_eager)

    built = {}
    for side in ("shardlang", "torchtitan") if args.order == "shardlang-first" else ("torchtitan", "shardlang"):
        built[side] = build_shardlang() if side == "shardlang" else build_titan()
    optims = {side: torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda) for side, model in built.items()}

    # Each tp group trains on its data-parallel rank's batch: the same tokens for both sides.
    tokens = titan_1b.example_input(args.batch, torch.Generator().manual_seed(rank // tp), tiny).to(device)

    def loss_context():
        if tp == 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    # shardlang's loss as its plan says (`compile loss`); torchtitan's as its loss component compiles it.
    titan_loss = titan_1b.loss
    if args.compile_loss and not args.titan_eager:
        titan_loss = torch.compile(titan_1b.loss, backend=backend)
    losses = {"shardlang": plan.loss(titan_1b.loss), "torchtitan": titan_loss}

    def forward_backward(side):
        model = built[side]
        with loss_context():
            loss = losses[side](model(tokens), tokens)
            loss.backward()

    def step(side):
        forward_backward(side)
        optims[side].step()
        optims[side].zero_grad(set_to_none=True)

    def timed(side) -> tuple[float, int]:
        return timed_step(memory, lambda: step(side))

    for _ in range(args.warmup):
        for side in SIDES:
            timed(side)
    counts = {}
    # A dispatch mode (the Recorder) cannot run inside compiled code: with --compile the compiled blocks
    # run eagerly for the count (torch.compiler.set_stance("force_eager")), the same modules and hooks.
    eager = torch.compiler.set_stance("force_eager") if args.compile else contextlib.nullcontext()
    for side in SIDES:
        recorder = Recorder()
        with eager, recorder:
            forward_backward(side)
        optims[side].zero_grad(set_to_none=True)
        counts[side] = recorder.counts()
    times, peaks = alternate(SIDES, args.steps, timed)
    profiles = {side: profile(lambda side=side: timed(side), args.profile) for side in SIDES} if args.profile else {}

    everyone = [None] * world
    dist.all_gather_object(everyone, (times, peaks, counts))
    if rank == 0:
        import torchtitan

        result = {
            "config": args.config,
            "plan": f"benchmarks/plans/{name}",
            "compile": backend if args.compile else None,
            "compile_loss": args.compile_loss,
            "titan_eager": args.titan_eager,
            "profile": profiles if rank == 0 else {},
            "order": args.order,
            "world": world,
            "dp": dp,
            "tp": tp,
            "card": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "torchtitan_version": getattr(torchtitan, "__version__", "?"),
            "model": "tiny (dry run)" if tiny else "llama3 1B",
            "batch": args.batch,
            "seq": titan_1b.seq(tiny),
            "steps": args.steps,
            "warmup": args.warmup,
            "counts": counts,
            "counts_identical": all(e[2]["shardlang"] == e[2]["torchtitan"] for e in everyone),
            "counts_per_rank": [e[2] for e in everyone],
        }
        card = next((k for k in PEAK_BF16 if k in result["card"]), None)
        flops = titan_1b.flops_per_token(tiny)
        tokens_per_step = args.batch * titan_1b.seq(tiny) * dp
        for side in SIDES:
            # The slowest rank sets each step's time.
            per_step = [max(e[0][side][i] for e in everyone) for i in range(args.steps)]
            median = statistics.median(per_step)
            rate = tokens_per_step / median
            result[side] = {
                "median_s": median,
                "tokens_per_s": rate,
                "mfu": rate * flops / (world * PEAK_BF16[card]) if card else None,
                "peak_bytes": max(e[1][side] for e in everyone),
            }
        result["throughput_ratio"] = result["shardlang"]["tokens_per_s"] / result["torchtitan"]["tokens_per_s"]
        peak_titan = result["torchtitan"]["peak_bytes"]
        result["peak_ratio"] = result["shardlang"]["peak_bytes"] / peak_titan if peak_titan else None
        report(result)
    dist.destroy_process_group()


def titan(config, args, world: int, tp: int, backend: str, device, compiled: bool):
    """torchtitan's side: its own ParallelDims and parallelize_llama, as its trainer calls them, then
    `to_empty` on the device and its own initialisation (see the docstring)."""
    import torch
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3.parallelize import parallelize_llama

    from benchmarks import titan_1b

    if device.type == "cpu":  # dry run: torchtitan's device_type is "cuda" wherever no accelerator is found
        parallel_dims.device_type = "cpu"
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=-1,
        tensor_parallel_degree=tp,
        enable_sequence_parallel=True,
        spmd_backend="partial_dtensor",
    )
    training = TrainingConfig(
        local_batch_size=args.batch,
        seq_len=titan_1b.seq(args.dry_run),
        mixed_precision_param="bfloat16",
        mixed_precision_reduce="float32",
    )
    # The loss is compiled (or not) by main(), the same function on both sides: components=["model"] here.
    compile_config = CompileConfig(enable=compiled, components=["model"], backend=backend)
    dims = parallel_dims.ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    with torch.device("meta"):
        model = config.build()
    model = parallelize_llama(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config=None,
        dump_folder=tempfile.gettempdir(),
    )
    if device.type == "cpu":  # gloo has no PreMulSum (torchtitan's gradient divide factor 1): plain SUM
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def report(result: dict) -> None:
    from benchmarks.gpu_throughput import print_profiles

    compiled = f"compiled per block ({result['compile']})" if result["compile"] else "eager"
    compiled += ", loss compiled" if result.get("compile_loss") else ""
    compiled += " (torchtitan's side eager)" if result.get("titan_eager") else ""
    print(
        f"{result['config']} (dp {result['dp']} x tp {result['tp']}), {compiled}, {result['model']}, batch "
        f"{result['batch']} x {result['seq']} per dp rank, on {result['world']} x {result['card']}, torch "
        f"{result['torch']}, torchtitan {result['torchtitan_version']}; built {result['order']}; median of "
        f"{result['steps']} steps each, alternating"
    )
    print(f"{'':12}{'step (s)':>10}{'tokens/s':>12}{'MFU':>8}{'peak (GiB)':>12}")
    for side in SIDES:
        row = result[side]
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
        print(
            f"{side:12}{row['median_s']:>10.4f}{row['tokens_per_s']:>12.0f}{mfu:>8}{row['peak_bytes'] / 2**30:>12.2f}"
        )
    print(f"throughput ratio shardlang / torchtitan: {result['throughput_ratio']:.4f}")
    peak = f"{result['peak_ratio']:.4f}" if result["peak_ratio"] is not None else "- (not measured)"
    print(f"peak memory ratio shardlang / torchtitan: {peak}")
    counts = result["counts"]
    if result["counts_identical"]:
        print(f"collectives of one forward+backward: identical on every rank: {counts['shardlang']}")
    else:
        print("collectives of one forward+backward: DIFFERENT")
        for rank, seen in enumerate(result["counts_per_rank"]):
            print(f"  rank {rank}: shardlang {seen['shardlang']}")
            print(f"  rank {rank}: torchtitan {seen['torchtitan']}")
    print_profiles(result.get("profile", {}))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
