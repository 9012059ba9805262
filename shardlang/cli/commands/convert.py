"""`shardlang convert`: a checkpoint directory to a torch state dict file, or back."""

from __future__ import annotations

import argparse
import sys

from ...frontend.diagnostics import PlanError
from ..output import emit_diagnostics
from ..status import OK, UNUSABLE


def run_convert(args: argparse.Namespace) -> int:
    """DCP checkpoint -> torch file, or torch file -> checkpoint; diagnostics (SL501) and exit 2 if not."""
    from ...checkpoints.converting import convert_checkpoint

    try:
        done = convert_checkpoint(args.source, args.target, optimizer=args.optimizer)
    except PlanError as e:
        emit_diagnostics(list(e.diagnostics), {}, "text", stream=sys.stderr)
        return UNUSABLE
    print(f"wrote {done.path}: {done.describe()}")
    return OK
