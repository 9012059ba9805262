"""The command line's grammar: every subcommand's flags, and the types their values must have."""

from __future__ import annotations

import argparse
import math
import re

from .._version import __version__
from ..explain.timing import GPUS
from .status import UsageError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardlang", description="Declarative sharding plans for PyTorch.")
    parser.add_argument("--version", action="version", version=f"shardlang {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    lint = commands.add_parser("lint", help="check a plan (and, given a model, the plan against it)")
    lint.add_argument("plan", metavar="PLAN", help="the .sl plan file")
    add_model(lint, required=False)
    lint.add_argument(
        "--world", type=_positive, metavar="N", help="world size: resolves `auto` mesh dims and checks the meshes fit"
    )
    add_params(lint)
    lint.add_argument(
        "--format", choices=("text", "json"), default="text", help="how to print diagnostics (default text)"
    )
    lint.add_argument(
        "--no-step",
        action="store_true",
        help="do not simulate a training step (fake tensors, a fake process group) to find what apply would hit",
    )

    apply = commands.add_parser(
        "apply", help="apply a plan to a model on N local workers (or under torchrun) and verify it"
    )
    apply.add_argument("plan", metavar="PLAN", help="the .sl plan file")
    add_model(apply, required=False)
    apply.add_argument(
        "--nproc",
        type=_positive,
        metavar="N",
        help="local worker processes (default: the size the meshes fix, or one per GPU)",
    )
    apply.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="gloo on cpu or nccl on cuda (default auto: cuda if there are enough GPUs)",
    )
    add_params(apply)
    apply.add_argument(
        "--verify", metavar="LIST|none", help="checks to run, comma-separated, instead of the plan's (none: no checks)"
    )
    apply.add_argument("--steps", type=_positive, metavar="N", help="training steps of the gradients check")
    apply.add_argument(
        "--optimizer",
        choices=("sgd", "adam", "adamw"),
        help="the gradients check's optimizer, in place of the plan's",
    )
    apply.add_argument(
        "--seed", type=_seed, default=0, metavar="N", help="the seed every rank builds the model with (default 0)"
    )
    apply.add_argument(
        "--timeout",
        type=_seconds,
        default=600.0,
        metavar="S",
        help="how long workers may take to start, and then the job (default 600)",
    )
    apply.add_argument("--json", action="store_true", help="print the report as one JSON object on stdout")
    apply.add_argument(
        "--debug", action="store_true", help="with a failure, also print the full traceback (torch's frames included)"
    )
    apply.add_argument(
        "--load",
        metavar="DIR",
        help="after applying the plan, load a DCP checkpoint (any plan, any world size) or a directory of Hugging "
        "Face safetensors weights (each rank reads only its shards)",
    )
    apply.add_argument(
        "--save", metavar="DIR", help="save a checkpoint after the checks pass (with optimizer state if gradients ran)"
    )
    apply.add_argument(
        "--save-format",
        choices=("dcp", "hf"),
        default="dcp",
        help="--save as a DCP checkpoint (default), or as Hugging Face safetensors weights and config.json that "
        "from_pretrained reads (model only; every rank writes its shards, then rank 0 joins them into whole "
        "tensors, one at a time)",
    )

    explain = commands.add_parser(
        "explain", help="what every rank will hold and send, at any world size, in one CPU process"
    )
    explain.add_argument("plan", metavar="PLAN", help="the .sl plan file")
    add_model(explain, required=False)
    explain.add_argument(
        "--world", type=_positive, metavar="N", help="the world size to simulate (default: what the meshes fix)"
    )
    explain.add_argument(
        "--rank", type=_non_negative, default=0, metavar="R", help="the rank whose view to show (default 0)"
    )
    add_params(explain)
    explain.add_argument(
        "--param", metavar="PATTERN", help="only these parameters; with svg (or text), draw their shards"
    )
    explain.add_argument(
        "--format", choices=("text", "json", "svg"), default="text", help="text (default), json or svg"
    )
    explain.add_argument(
        "--no-step", dest="step", action="store_false", help="skip simulating a training step (no collectives; faster)"
    )
    explain.add_argument(
        "--full-step",
        action="store_true",
        help="simulate every block of a repeated stack (default: 2, 3 and 4 blocks, extrapolated when each block adds the same)",
    )
    explain.add_argument(
        "--batch", type=_positive, metavar="N", help="the per-replica batch handed to example_input (default 2 x TP)"
    )
    explain.add_argument(
        "--fit", metavar="MEMORY", help="also find the largest batch whose predicted peak fits MEMORY (e.g. 80GiB)"
    )
    explain.add_argument("--compare", metavar="PLAN", help="a second plan for the same model and world, side by side")
    explain.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="the accelerator of the time estimate")
    explain.add_argument("--flops", metavar="FLOP/S", help="peak bf16 FLOP/s instead of the GPU's (e.g. 989e12)")
    explain.add_argument("--hbm", metavar="BYTES/S", help="HBM bandwidth instead of the GPU's (e.g. 3.35TB/s)")
    explain.add_argument(
        "--link",
        metavar="DIM=BW[:LAT],...",
        help="bandwidth (and latency) per mesh dim, e.g. dp=50GB/s:20us,tp=450GB/s; host=... is CPU offload's PCIe link",
    )
    explain.add_argument(
        "--gpus-per-node", type=_positive, default=8, metavar="N", help="which mesh dims stay inside a node (default 8)"
    )
    explain.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    explain.add_argument(
        "--timeout",
        type=_seconds,
        default=600.0,
        metavar="S",
        help="stop if loading the model or simulating the step takes longer (default 600)",
    )

    compile_ = commands.add_parser("compile", help="print the plan as plain torch code")
    compile_.add_argument("plan", metavar="PLAN", help="the .sl plan file")
    add_model(compile_, required=False)
    compile_.add_argument("--world", type=_positive, metavar="N", help="world size (default: what the meshes fix)")
    add_params(compile_)
    compile_.add_argument("--emit", choices=("python",), default="python", help="what to print (default python)")
    compile_.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")

    init = commands.add_parser(
        "init", help="write a starter plan for a model: FSDP2 on its repeated blocks, its own TP plan (transformers)"
    )
    add_model(init, required=False)
    init.add_argument("--tp", type=_positive, default=1, metavar="N", help="tensor-parallel size (default 1: none)")
    init.add_argument(
        "--dp", type=_positive, metavar="N", help="data-parallel size (default: auto, what the world leaves)"
    )
    init.add_argument(
        "--ep",
        type=_positive,
        default=1,
        metavar="N",
        help="expert-parallel size, from a transformers MoE's own ep_plan; the ep ranks borrow data-parallel ones "
        "(default 1: none)",
    )
    init.add_argument(
        "--cp",
        type=_positive,
        default=1,
        metavar="N",
        help="context-parallel size: each block's attention over sequences split N ways (default 1: none)",
    )
    init.add_argument(
        "--pp",
        type=_positive,
        default=1,
        metavar="N",
        help="pipeline-parallel size: the stack of blocks cut into N stages under 1F1B (default 1: none)",
    )
    init.add_argument("-o", "--output", metavar="PLAN", help="write the plan to PLAN instead of stdout")
    init.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="only lint the plan: do not apply it and run its checks on CPU workers (tp x dp of them, dp 2 if auto)",
    )
    init.add_argument(
        "--timeout", type=_seconds, default=600.0, metavar="S", help="how long the check may take (default 600)"
    )
    init.set_defaults(plan=None, params=[], world=None)

    search = commands.add_parser(
        "search", help="the plan explain predicts fastest among those that fit, linted and applied before it is written"
    )
    add_model(search, required=False)
    search.add_argument("--world", type=_positive, required=True, metavar="N", help="the number of GPUs to plan for")
    search.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="the accelerator")
    search.add_argument(
        "--gpus-per-node", type=_positive, default=8, metavar="G", help="GPUs a node holds (tp stays within one)"
    )
    search.add_argument(
        "--memory",
        metavar="SIZE",
        help="what a GPU's predicted peak may take (default: 95%% of what torch can allocate on --gpu)",
    )
    search.add_argument(
        "--tokens-per-step",
        type=_positive,
        metavar="T",
        help="tokens per optimizer step over every replica, held fixed (default: 2 sequences per GPU)",
    )
    search.add_argument("-o", "--output", metavar="PLAN", help="write the chosen plan to PLAN instead of stdout")
    search.add_argument(
        "--check",
        type=int,
        default=3,
        metavar="K",
        help="lint (with the step) and apply on CPU workers the best K, in order, until one passes (default 3; 0: none)",
    )
    search.add_argument(
        "--jobs", type=int, default=0, metavar="J", help="explain processes side by side (default: cores, at most 8)"
    )
    search.add_argument(
        "--candidates",
        metavar="DIR",
        help="also write every plan that fits to DIR, best first (01.sl, 02.sl, ...), each with its prediction",
    )
    search.add_argument(
        "--timeout",
        type=_seconds,
        default=600.0,
        metavar="S",
        help="how long each check (lint's step, then apply on CPU) may take (default 600)",
    )
    search.set_defaults(plan=None, params=[])

    convert = commands.add_parser("convert", help="a checkpoint directory to a torch state dict file, or back")
    convert.add_argument("source", metavar="SOURCE", help="a checkpoint directory, or a .pt file of a state dict")
    convert.add_argument("target", metavar="TARGET", help="the .pt file to write, or the checkpoint directory")
    convert.add_argument(
        "--optimizer", action="store_true", help="checkpoint to file: write {'model': ..., 'optimizer': ...}"
    )

    return parser


def add_model(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        nargs=None if required else "?",
        help="model file defining build_model() (docs/language.md §6)",
    )
    parser.add_argument(
        "--entry", metavar="PKG.MODULE:FUNCTION", help="build_model as an importable function instead of MODEL"
    )
    parser.add_argument(
        "--hf",
        metavar="PATH",
        help="a Hugging Face transformers model instead of MODEL: a directory with config.json, or the file "
        "(built from the config; random token ids; the causal-LM loss; needs pip install 'shardlang[hf]')",
    )
    parser.add_argument(
        "--seq", type=_positive, metavar="N", help="with --hf: tokens per sequence of the example inputs (128)"
    )


def add_params(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-D", dest="params", action="append", default=[], metavar="NAME=VALUE", help="override a `param` of the plan"
    )


#: The largest world size, rank or step count a flag takes (a world beyond it is not a real one).
MAX_COUNT = 2**31 - 1
#: The longest --timeout: a week (torch turns it into a timedelta, which overflows past ~10**9 days).
MAX_SECONDS = 7 * 24 * 3600.0
#: torch.manual_seed takes what fits in 64 bits, signed or unsigned.
SEEDS = range(-(2**63), 2**64)


def _integer(text: str, what: str, lowest: int, highest: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text[:40]!r}") from None
    if not lowest <= value <= highest:
        shown = str(value) if len(str(value)) <= 24 else f"a {len(str(value))}-digit number"
        raise argparse.ArgumentTypeError(f"expected {what} from {lowest} to {highest}, got {shown}")
    return value


def _positive(text: str) -> int:
    return _integer(text, "a positive integer", 1, MAX_COUNT)


def _non_negative(text: str) -> int:
    return _integer(text, "a non-negative integer", 0, MAX_COUNT)


def _seed(text: str) -> int:
    return _integer(text, "an integer seed (what torch.manual_seed takes)", SEEDS.start, SEEDS.stop - 1)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text[:40]!r}") from None
    if not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected seconds greater than 0 and at most {MAX_SECONDS:.0f}, got {text}")
    return value


def defines(pairs: list[str]) -> dict[str, str]:
    params = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UsageError(f"-D expects NAME=VALUE, got {pair!r}")
        params[name] = value
    return params
