"""Where `apply` and `init` run their job: on local worker processes or as one rank of torchrun's group;
and what a job that failed on a worker, or a report, prints."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import attrs
from rich.console import Console

from ..frontend.source import Source
from .output import Out, emit_diagnostics
from .status import FOUND, UNUSABLE


def prepare_workers(args: argparse.Namespace) -> None:
    """Start the workers' forkserver (launch.servers.context) now, so that it imports torch and shardlang
    while this process loads the model and lints the plan, not after: a command that starts workers then
    waits for no import. It and the workers write nothing to this process's stdout or stderr (the workers
    log to files), so a command that fails before starting them ends as soon as it exits."""
    from ..launch.servers import start_forkserver

    model = Path(args.model) if getattr(args, "model", None) else None
    try:
        hugging_face = bool(getattr(args, "hf", None)) or (
            model is not None and model.is_file() and "transformers" in model.read_text(errors="replace")
        )
    except OSError:
        hugging_face = False
    start_forkserver(("transformers",) if hugging_face else (), quiet=True)


def run_local(job, world: int, device: str, timeout: float, console: Console, debug: bool, out: Out):
    """The job on `world` local workers; their stderr (torch's and gloo's logs) is kept in a temporary
    directory and printed only with --debug, after a failure."""
    import tempfile

    from ..launch.failures import WorkerError
    from ..launch.job import run
    from ..launch.workers import WorkerPool

    backend = "nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="shardlang-logs-") as logs:
        try:
            with console.status(f"starting {world} workers ({backend})") as status:

                def show(rank: int, message: str) -> None:
                    if rank == 0:
                        status.update(f"rank 0: {message}")

                pool = WorkerPool(world, backend, timeout_s=timeout, on_progress=show, log_dir=logs)
                out.pool = pool
                try:
                    report = pool.run(run, job, timeout_s=timeout)[0]
                finally:
                    warnings = pool.close()
        except WorkerError:
            if debug:
                _print_logs(logs)
            raise
    return report, warnings


def applied_on_cpu(args: argparse.Namespace, plan, source: Source, model_file, world: int, order, raised=None):
    """`plan` applied at `world` on CPU workers (gloo), as `apply --device cpu` does, with its checks, where
    `init` and `search` check a plan before writing it: the report, or None where the job did not run to its
    end (said on stderr, and the error's message appended to the list `raised` where given). `args` names the model
    (MODEL, --entry, --hf) and the --timeout."""
    from ..launch.failures import WorkerError
    from ..launch.job import Job
    from .signals import terminable

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the plan's `auto` mesh means cpu here, as on the workers
    job = Job(plan, {}, args.model, args.entry, plan.checks, 0, model_file=model_file if args.hf else None, order=order)
    try:
        with terminable():
            console = Console(file=sys.stderr, highlight=False)
            return run_local(job, world, "cpu", args.timeout, console, False, Out(json=False))[0]
    except WorkerError as e:
        worker_failed(e, {source.name: source}, False, Out(json=False))
        if raised is not None:
            raised.append(str(e))  # its words only: the error's frames would keep the pool alive to the exit
        return None


def _print_logs(folder: str) -> None:
    for path in sorted(Path(folder).glob("rank*.log")):
        text = path.read_text(errors="replace").rstrip()
        if text:
            print(f"--- {path.stem}'s stderr ---\n{text}", file=sys.stderr)


def run_under_torchrun(job, device: str, console: Console):
    """Join torchrun's process group; rank 0 returns the report, the others None."""
    import torch
    import torch.distributed as dist

    from ..launch.job import run
    from ..launch.workers import destroy_process_groups

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = int(os.environ["RANK"])
    try:
        report = run(job)
    except Exception as e:  # noqa: BLE001 - this rank's failure, said as the local launcher says a worker's
        from ..launch.workers import error_of

        raise error_of(rank, e) from None
    finally:
        destroy_process_groups()
    return report if rank == 0 else None


def worker_failed(error, sources: dict[str, Source], debug: bool, out: Out) -> int:
    """A job that failed on a worker: a check that raised is SL400 at its statement (exit 1); otherwise one
    line naming the rank, and the frames of the user's own files (exit 2). --debug adds the traceback.
    With --json, the object says the same: the failure, the exit status and what each rank said."""
    status = FOUND if error.diagnostic is not None and error.diagnostic.code == "SL400" else UNUSABLE
    failure = {"kind": error.kind, "rank": error.rank, "message": error.headline, "user_frames": list(error.user)}
    out.failed(status, failure, error.diagnostics, error.ranks)
    if error.diagnostics:
        emit_diagnostics(list(error.diagnostics), sources, "text", stream=sys.stderr)
    else:
        print(f"shardlang: error: {error.headline}", file=sys.stderr)
        for frame in error.user:
            print(f"  at {frame}", file=sys.stderr)
    if debug and error.details:
        print(f"rank {error.rank}'s traceback:\n{error.details.rstrip()}", file=sys.stderr)
    elif error.details and error.diagnostic is None:
        print("  (run with --debug for the full traceback)", file=sys.stderr)
    return status


def show_report(report, warnings: list[str], sources: dict[str, Source], args: argparse.Namespace, out: Out) -> int:
    """Print the report (table or JSON) and return the exit status it calls for."""
    from ..launch.report import render

    status = report.exit_code
    report = attrs.evolve(report, warnings=report.warnings + tuple(warnings), exit_status=status)
    if args.json:
        out.report(report)
    else:
        render(report, sources, Console(file=sys.stdout, highlight=False, soft_wrap=True))
    return status
