"""Diagnostics as data: the table of stable codes (docs/diagnostics.md), the Diagnostic record, its text and JSON forms."""

from __future__ import annotations

import difflib
import enum
import json
from collections.abc import Iterable, Mapping, Sequence

from attrs import field, frozen

from .source import Source, Span


class Severity(enum.Enum):
    ERROR = "error"
    WARNING = "warning"


class Code(enum.Enum):
    """The stable diagnostic codes, each with its severity and what it means: the one table of codes.
    docs/diagnostics.md shows it word for word (tests/test_docs.py holds the two to each other)."""

    SL100 = (Severity.ERROR, "syntax error")
    SL101 = (Severity.ERROR, "unknown keyword: statement, option, argument, layout, dtype or check name")
    SL102 = (Severity.ERROR, "invalid value (bad size, version, file too large, ...)")
    SL103 = (
        Severity.ERROR,
        "declared or given twice: a name, an argument, an option, a check or a once-only statement",
    )
    SL104 = (Severity.ERROR, "undefined reference: mesh, mesh dim, param or style")
    SL105 = (Severity.ERROR, "mesh shape does not fit the world size, or more than one `auto` dim")
    SL106 = (Severity.ERROR, "fully_shard / replicate mesh is not 1-D or 2-D, or hybrid_shard on a 1-D mesh")
    SL107 = (Severity.ERROR, "parallelize mesh is not 1-D")
    SL108 = (Severity.WARNING, "a `use` takes a built-in style's name: the plan's own style is used instead")
    SL200 = (Severity.ERROR, "pattern matches no module")
    SL201 = (Severity.ERROR, "module matched by two rules, or made a unit of one kind twice")
    SL202 = (Severity.ERROR, "style does not apply to this module type")
    SL203 = (Severity.WARNING, "sharded dimension not divisible by the mesh dim size (uneven shards)")
    SL204 = (Severity.ERROR, "tied parameters would get different placements or different units")
    SL205 = (Severity.ERROR, "module is both a fully_shard unit and a replicate unit")
    SL206 = (
        Severity.WARNING,
        "parameters outside every fully_shard/replicate unit while a data-parallel dim > 1 exists",
    )
    SL207 = (Severity.ERROR, "loss_parallel without a colwise(output=shard(-1), local_output=false) output layer")
    SL208 = (Severity.ERROR, "meshes of different device types are combined on one module")
    SL209 = (Severity.WARNING, "init meta but some parameters belong to modules without the init method")
    SL210 = (
        Severity.WARNING,
        "a parameter replicated over a TP dim sits where that dim's activations are sharded: partial gradients",
    )
    SL211 = (Severity.ERROR, "pipeline split point is not a block of the module stack, or points out of order")
    SL212 = (Severity.ERROR, "pipeline stage would hold no block")
    SL213 = (Severity.ERROR, "pipeline stage count is not the pp size times stages_per_rank")
    SL214 = (Severity.ERROR, "parameters shared across pipeline stages (tied weights)")
    SL215 = (Severity.ERROR, "pipeline schedule does not fit stages_per_rank or microbatches")
    SL216 = (
        Severity.ERROR,
        "pipeline mesh dim used by another statement; loss_parallel or init rank0 with a pipeline; a pipeline compiled without its model",
    )
    SL217 = (
        Severity.ERROR,
        "a mesh dim larger than 1 that no statement uses: its ranks train on different data and nothing averages them",
    )
    SL218 = (
        Severity.ERROR,
        "a mesh dim that both splits tensors (parallelize) and shards or replicates units (fully_shard, replicate)",
    )
    SL219 = (
        Severity.ERROR,
        "context_parallel's dim also split by a parallelize block, or reduced by no fully_shard or replicate block",
    )
    SL220 = (
        Severity.ERROR,
        "lint's simulated training step raises in a module: what it received against what its rule expects",
    )
    SL221 = (Severity.ERROR, "lint's simulated training step hands the loss a sharded output, or the loss raises")
    SL222 = (
        Severity.ERROR,
        "lint's simulated training step hands a module with whole plain parameters a piece of its input: partial gradients nothing sums",
    )
    SL223 = (
        Severity.ERROR,
        "context parallelism over a model with a module that mixes positions outside the attention it splits",
    )
    SL224 = (
        Severity.ERROR,
        "init meta leaves parameters that no initialiser writes (lint ran the initialisers on the meta model)",
    )
    SL300 = (Severity.ERROR, "apply failed (the model is left exactly as it was)")
    SL301 = (
        Severity.ERROR,
        "a step the installed torch cannot run correctly, found before apply: some uneven shards and pipeline schedules",
    )
    SL400 = (Severity.ERROR, "a verification check failed")
    SL500 = (
        Severity.ERROR,
        "checkpoint does not fit the model or optimizer (keys, shapes, dtypes); nothing was loaded",
    )
    SL501 = (
        Severity.ERROR,
        "checkpoint cannot be read or written (not a checkpoint, I/O error); nothing was changed",
    )

    @property
    def severity(self) -> Severity:
        return self.value[0]

    @property
    def meaning(self) -> str:
        return self.value[1]

    def __str__(self) -> str:
        return self.name


#: Each code as a constant. Call sites import the codes they use by name, so a misspelt code fails when
#: its module is imported (and in ruff), never when a diagnostic is rendered.
(
    SL100,
    SL101,
    SL102,
    SL103,
    SL104,
    SL105,
    SL106,
    SL107,
    SL108,
    SL200,
    SL201,
    SL202,
    SL203,
    SL204,
    SL205,
    SL206,
    SL207,
    SL208,
    SL209,
    SL210,
    SL211,
    SL212,
    SL213,
    SL214,
    SL215,
    SL216,
    SL217,
    SL218,
    SL219,
    SL220,
    SL221,
    SL222,
    SL223,
    SL224,
    SL300,
    SL301,
    SL400,
    SL500,
    SL501,
) = Code
if any(globals()[code.name] is not code for code in Code):
    raise ImportError("the code constants are out of step with the Code table")

#: code -> (severity, what it means), by code name.
CODES: dict[str, tuple[Severity, str]] = {code.name: code.value for code in Code}


def _code(code: Code | str) -> str:
    """A code's name; ValueError at once for a code that is not in the table."""
    if isinstance(code, Code):
        return code.name
    if code not in CODES:
        raise ValueError(f"{code!r} is not a diagnostic code")
    return code


@frozen
class Diagnostic:
    """One problem: a stable code, a message, where it is (None for problems outside any plan) and what to do."""

    code: str = field(converter=_code)
    message: str
    span: Span | None = None
    help: tuple[str, ...] = field(default=(), converter=tuple)
    label: str = ""

    @property
    def severity(self) -> Severity:
        return CODES[self.code][0]

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR

    def to_json(self) -> dict[str, object]:
        span = self.span
        return {
            "code": self.code,
            "severity": self.severity.value,
            "message": self.message,
            "file": span.file if span else None,
            "line": span.line if span else None,
            "col": span.col if span else None,
            "end_line": span.end_line if span else None,
            "end_col": span.end_col if span else None,
            "help": "\n".join(self.help) or None,
        }


def did_you_mean(word: str, candidates: Iterable[str]) -> tuple[str, ...]:
    """A `did you mean` help line for a misspelt name, or nothing when no candidate is close.

    Close means a few typing slips away (insertions, deletions, substitutions, swapped neighbours:
    `pt` for `tp`) or similar by difflib's ratio (`colwse` for `colwise`); the nearest come first.
    Names longer than SUGGEST_LENGTH are not compared (both measures are quadratic in the length), nor
    are pairs whose lengths alone rule out both kinds of closeness.
    """
    if len(word) > SUGGEST_LENGTH:
        return ()
    scored = []
    for candidate in set(candidates):
        if len(candidate) > SUGGEST_LENGTH:
            continue
        gap, total = abs(len(word) - len(candidate)), len(word) + len(candidate)
        if gap > max(1, len(candidate) // 3) and 2 * min(len(word), len(candidate)) < 0.6 * total:
            continue
        distance = _edit_distance(word.lower(), candidate.lower())
        ratio = difflib.SequenceMatcher(None, word, candidate).ratio()
        if distance <= max(1, len(candidate) // 3) or ratio >= 0.6:
            scored.append((distance, -ratio, candidate))
    # None much further than the nearest: `colwse` is `colwise` or `rowwise`, not `colwise_conv1d`.
    nearest = min((d for d, _, _ in scored), default=0)
    close = [c for d, _, c in sorted(scored)[:3] if d <= nearest + 2]
    if not close:
        return ()
    return ("did you mean " + " or ".join(f"'{c}'" for c in close) + "?",)


#: The longest name `did_you_mean` compares (module paths are far shorter; a 30,000-character name is an attack).
SUGGEST_LENGTH = 100


def _edit_distance(a: str, b: str) -> int:
    """Optimal string alignment distance: Levenshtein with swaps of adjacent characters."""
    previous2, previous = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb))
            if previous2 is not None and i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                current[j] = min(current[j], previous2[j - 2] + 1)
        previous2, previous = previous, current
    return previous[-1]


#: How many names a message lists before it says how many more there are.
LISTED = 8


def few(names: Iterable[str], limit: int = LISTED) -> str:
    """`a, b, c and 5 more`: the first `limit` names, then how many were left out."""
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def few_lines(lines: Iterable[str], limit: int = LISTED) -> tuple[str, ...]:
    """The first `limit` lines (help lines, one item each), then `... and 5 more`."""
    lines = list(lines)
    return (*lines[:limit], *([f"... and {len(lines) - limit} more"] if len(lines) > limit else []))


def errors(diagnostics: Iterable[Diagnostic]) -> list[Diagnostic]:
    return [d for d in diagnostics if d.is_error]


def sort_key(d: Diagnostic) -> tuple:
    s = d.span
    return (s is None, s.file if s else "", s.line if s else 0, s.col if s else 0, d.code)


def render_text(diagnostic: Diagnostic, sources: Mapping[str, Source] = {}) -> str:
    """The text form (docs/diagnostics.md): `file:line:col: severity[CODE] message`, the source line, carets, help lines."""
    d, span = diagnostic, diagnostic.span
    head = f"{d.severity.value}[{d.code}] {d.message}"
    if span is None:
        lines = [f"shardlang: {head}"]
        lines += [f"  = help: {h}" for h in d.help]
        return "\n".join(lines)
    lines = [f"{span}: {head}"]
    source = sources.get(span.file)
    number = str(span.line)
    gutter = " " * (len(number) + 2)
    if source is not None:
        text = source.line_text(span.line).rstrip("\r\n")
        start = min(max(span.col - 1, 0), len(text))
        end = span.end_col - 1 if span.end_line == span.line else len(text)
        width = max(min(end, len(text)) - start, 1)
        # Copy tabs from the source line so that the carets line up in any terminal.
        pad = "".join(c if c == "\t" else " " for c in text[:start])
        carets = pad + "^" * width + (f" {d.label}" if d.label else "")
        lines += [f"{gutter}|", f" {number} | {text}", f"{gutter}| {carets}"]
    lines += [f"{gutter}= help: {h}" for h in d.help]
    return "\n".join(lines)


def render_all(diagnostics: Sequence[Diagnostic], sources: Mapping[str, Source] = {}) -> str:
    """Every diagnostic in text form, then a one-line count."""
    blocks = [render_text(d, sources) for d in diagnostics]
    n_err = len(errors(diagnostics))
    n_warn = len(diagnostics) - n_err
    parts = [f"{n} {word}{'' if n == 1 else 's'}" for n, word in ((n_err, "error"), (n_warn, "warning")) if n]
    if parts:
        blocks.append(", ".join(parts))
    return "\n\n".join(blocks)


def render_json(diagnostics: Sequence[Diagnostic]) -> str:
    return json.dumps([d.to_json() for d in diagnostics], indent=2)


@frozen(auto_exc=True)
class PlanError(Exception):
    """A plan that cannot be used, with every error (and warning) found; `str()` renders them as text."""

    diagnostics: tuple[Diagnostic, ...] = field(converter=tuple)
    sources: Mapping[str, Source] = field(factory=dict, eq=False)
    details: str = field(default="", eq=False, repr=False)  # a traceback behind it (apply's SL300), for --debug

    def __str__(self) -> str:
        return render_all(self.diagnostics, self.sources)
