"""The zoo's planted mistake (issue 41): a starter plan that passed every check with tensor parallelism,
its first row-wise rule inside the blocks removed. The module it governed (an attention's output
projection, an MLP's down projection) then meets its column-wise neighbour's shard of the activation with
its whole weight: lint and apply must both fail, naming that module."""

from __future__ import annotations

import re
from pathlib import Path

ROWWISE = re.compile(r"^[ \t]+(\S+)[ \t]*:[ \t]*rowwise\b[^\n]*\n", re.MULTILINE)


def planted(text: str) -> tuple[str, str] | None:
    """`text` without its first rowwise rule on a module inside a stack's blocks (`stack.*.path`), and that
    rule's pattern; None where the plan has no such rule."""
    for found in ROWWISE.finditer(text):
        if ".*." in found.group(1):
            return text[: found.start()] + text[found.end() :], found.group(1)
    return None


def named(pattern: str, said: str) -> bool:
    """Whether `said` names a module the rule's pattern matched (`model.layers.*.mlp.down_proj` names
    `model.layers.0.mlp.down_proj`)."""
    regex = re.escape(pattern).replace(r"\*", r"\d+")
    return re.search(rf"(?<![\w.]){regex}(?![\w])", said) is not None


def plant(plan: Path, model: Path, world: str, timeout: float, shardlang) -> dict | None:
    """Lint and apply of `plan` with its mistake planted (None where it has none): whether each failed, and
    whether each named the module."""
    found = planted(plan.read_text(encoding="utf-8"))
    if found is None:
        return None
    text, pattern = found
    wrong = plan.with_name(plan.stem + ".planted.sl")
    wrong.write_text(text, encoding="utf-8")
    lint = shardlang(["lint", str(wrong), str(model), "--world", world, "--format", "json"], timeout)
    applied = shardlang(["apply", str(wrong), str(model), "--nproc", world, "--json"], timeout + 30)
    return {
        "rule": pattern,
        "lint_failed": lint.exit == 1,
        "lint_named": named(pattern, lint.stdout),
        "apply_failed": applied.exit == 1,
        "apply_named": named(pattern, applied.stdout + applied.stderr),
        "caught": lint.exit == 1
        and applied.exit == 1
        and named(pattern, lint.stdout)
        and named(pattern, applied.stdout + applied.stderr),
    }
