"""What `shardlang init` leaves out of (or adds to) a starter plan after lint's simulated step found it cannot
run, and why.

init writes a plan, lints it with the step, and where an error points at a line it wrote, leaves that line's
feature out and tries again (cli.commands.init): a tensor- or expert-parallel rule (Llama 4's rowwise
`shared_expert.down_proj`, whose output the model adds to in place), context parallelism (a Mamba mixer
beside the attention it splits: SL223), the pipeline (stages the step cannot run), `mixed_precision` (a
model that meets a float32 mask with a bf16 weight, or runs an FFT bf16 has no kernel for), and last a
stack's blocks as fully_shard units (a model that reads a block's parameter outside its forward), the root
then holding them. A shape error raised in a module no rule
governs (pointing at the unit holding it) is the split's: the rules of the nearest module above it that still
has some go first (NeoMME's per-head `alpha` beside its attention's colwise heads). Each is written as a
comment saying what lint found, so the plan says why it is smaller than what was asked for. One error is
answered by adding a rule instead: a module no rule governs whose own whole parameters meet a piece of their
input (SL222 on an activation between a colwise and a rowwise projection, apertus' xIELU with its learned
alphas) gets `replicated_with_grad_allreduce`, which sums each rank's share of their gradients over tp;
apply's gradients check then says whether that was right.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import attrs
from attrs import frozen

#: At most this many features left out, one a round, before a starter is written as it is with what failed.
ROUNDS = 6

#: SL222's message for whole parameters that met a piece of their input (explain.rehearsal._partial_gradients):
#: the first module it names.
WHOLE_PARAMETERS = re.compile(r"hands module '([^']+)' \([^)]*\).* whose parameters \([^)]*\) are whole on every rank")

#: The module a step's error names as raised in (explain.rehearsal), and the shapes that did not fit: an
#: error a split of activations makes (tensor parallelism), not one of dtypes or of units.
RAISED_IN = re.compile(r"raises in module '([^']+)'")
SHAPE_ERROR = re.compile(
    r"size of tensor a \(\d+\) must match|broadcast a dimension|shapes cannot be multiplied|"
    r"is invalid for input of size|expected shape|must match the size"
)

#: A block's opening line in the plans init writes, and which feature its lines belong to.
BLOCKS = (
    (re.compile(r"^parallelize\b"), "rule"),
    (re.compile(r"^context_parallel\b"), "cp"),
    (re.compile(r"^pipeline\b"), "pp"),
    (re.compile(r"^fully_shard\b"), "unit"),
)


@frozen
class Drops:
    """What a starter leaves out, each with why: rules by key (tensor- and expert-parallel), context
    parallelism, mixed precision, units by pattern (`stack.*`); and the modules (by pattern) it gives
    `replicated_with_grad_allreduce`, each with why."""

    rules: Mapping[str, str] = attrs.field(factory=dict)
    cp: str | None = None
    mixed_precision: str | None = None
    units: Mapping[str, str] = attrs.field(factory=dict)
    #: Init statements ("init meta with init_states", "init meta") whose init check alone failed in apply, with
    #: its message.
    inits: Mapping[str, str] = attrs.field(factory=dict)
    summed: Mapping[str, str] = attrs.field(factory=dict)
    #: Pipeline parallelism (the `pipeline` block), left out with why.
    pp: str | None = None

    def __bool__(self) -> bool:
        found = (self.rules, self.cp, self.mixed_precision, self.units, self.inits, self.summed, self.pp)
        return any(bool(f) for f in found)

    def said(self) -> list[str]:
        """One line per feature left out, for init's output."""
        lines = [f"left out rule {key}: {why}" for key, why in self.rules.items()]
        lines += [f"left out context parallelism: {self.cp}"] if self.cp else []
        lines += [f"left out pipeline parallelism: {self.pp}"] if self.pp else []
        lines += [f"left out mixed_precision: {self.mixed_precision}"] if self.mixed_precision else []
        lines += [f"left out the units {key}: {why}" for key, why in self.units.items()]
        lines += [f"added rule {key} : replicated_with_grad_allreduce: {why}" for key, why in self.summed.items()]
        return lines + [f"left out `{key}`: its init check failed" for key in self.inits]

    def after_init(self, init, message: str) -> Drops | None:
        """These drops and the plan's `init` statement (an ir.Init) whose init check alone failed in apply
        (torchtitan's Llama built by a build_model() that never calls init_states: nn.Linear's own
        initialisation, not init_states'), or None where it was tried already."""
        key = str(init)
        return None if key in self.inits else attrs.evolve(self, inits={**self.inits, key: _why(message)})

    def after_pipeline(self, message: str) -> Drops | None:
        """These drops and the pipeline, which apply found cannot run (`message`: its words from the
        refusal on), where lint's step could not see it (it stopped short); None where it is left out."""
        return None if self.pp else attrs.evolve(self, pp=f"apply found that {_why(message)}")

    def after(self, text: str, line: int, message: str) -> Drops | None:
        """These drops and the feature of `text`'s line `line` (1-based) that an error `message` points at,
        or None when that line is no feature init can leave out (or it already did)."""
        lines = text.splitlines()
        if not 0 < line <= len(lines):
            return None
        why = _why(message)
        if "context parallelism" in message and not self.cp and any(t.startswith("context_parallel") for t in lines):
            # context attention's own refusal (an explicit mask, dropout), raised in a module inside a matched
            # attention: the diagnostic points at the unit holding it, and what cannot run is the cp
            return attrs.evolve(self, cp=why)
        summed = self._summed(lines, message)
        if summed is not None:
            return summed
        block = _block_of(lines, line - 1)
        here = lines[line - 1].strip()
        key = _rule_key(lines[line - 1]) if block == "rule" else None
        if key is not None:
            return None if key in self.rules else attrs.evolve(self, rules={**self.rules, key: why})
        if block == "cp":
            return None if self.cp else attrs.evolve(self, cp=why)
        if block == "pp":  # the words are said whole in the plan's comment: whose they are too
            stepped = message.startswith("the simulated training step ")
            return None if self.pp else attrs.evolve(self, pp=f"lint's simulated step {why}" if stepped else why)
        if block != "unit":
            return None
        split = self._split_by_rules(lines, message, why)
        if split is not None:
            return split
        if self.mixed_precision is None and any(m.strip().startswith("mixed_precision") for m in lines):
            return attrs.evolve(self, mixed_precision=why)
        unit = here.removeprefix("each ").strip() if here.startswith("each ") else None
        if unit is None or unit in self.units:
            return None
        return attrs.evolve(self, units={**self.units, unit: why})

    def _split_by_rules(self, lines: list[str], message: str, why: str) -> Drops | None:
        """These drops and the rules under the nearest module above the one a shape error (`message`) was
        raised in that holds rules: a module no rule governs whose forward meets a tensor the rules around it
        split with one it keeps whole (NeoMME's per-head `alpha` beside its attention's column-wise heads,
        from transformers' own tp_plan). The diagnostic points at the unit holding it; what cannot run is
        the split. Asked again, the next module up that still has rules (the block's). None where the error
        is no shape error, or no rule below the root is left to take."""
        found = RAISED_IN.search(message)
        if found is None or not SHAPE_ERROR.search(message):
            return None
        keys = [_rule_key(t) for i, t in enumerate(lines) if _block_of(lines, i) == "rule"]
        keys = [key for key in keys if key is not None and key not in self.rules]
        parts = re.sub(r"\.\d+(?=\.|$)", ".*", found.group(1)).split(".")
        for depth in range(len(parts) - 1, 0, -1):  # the root holds every rule: never taken whole
            above = ".".join(parts[:depth]) + "."
            taken = [key for key in keys if key.startswith(above)]
            if taken:
                return attrs.evolve(self, rules={**self.rules, **dict.fromkeys(taken, why)})
        return None

    def _summed(self, lines: list[str], message: str) -> Drops | None:
        """These drops and `replicated_with_grad_allreduce` for the modules SL222's `message` names as holding
        whole parameters that met a piece of their input, where the plan has tensor parallelism to sum
        their gradients over and no rule for them was tried and left out already; else None."""
        found = WHOLE_PARAMETERS.search(message)
        if found is None or not any(t.startswith("parallelize on world.tp") for t in lines):
            return None
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", found.group(1))  # every block's, as the rules are written
        if pattern in self.summed or pattern in self.rules:
            return None
        why = "its whole parameters meet a piece of its input; their gradients are summed over tp"
        return attrs.evolve(self, summed={**self.summed, pattern: why})


def settle(
    written: Callable[[Drops], str],
    linted: Callable[[str], tuple],
    name: str,
    rounds: int = ROUNDS,
    drops: Drops | None = None,
) -> tuple[str, object, list, Drops]:
    """A starter written (`written(drops)`) and linted (`linted(text)`: its plan and sorted diagnostics),
    leaving out one feature a round that an error in the plan `name` points at, at most `rounds` times: the
    last text, its plan, its diagnostics and what was left out. `init` and `search` settle their starters so."""
    drops = drops or Drops()
    for _ in range(rounds):
        text = written(drops)
        plan, found = linted(text)
        error = next((d for d in found if d.is_error and d.span is not None and d.span.file == name), None)
        fewer = error and drops.after(text, error.span.line, error.message)
        if not fewer:
            break
        drops = fewer
    return text, plan, found, drops


def _rule_key(line: str) -> str | None:
    """The key of the rule on `line` of a `parallelize` block init wrote, or None (its opening line, a comment)."""
    stripped = line.strip()
    if not line[:1].isspace() or ":" not in stripped or stripped.startswith("#"):
        return None
    return stripped.split(":", 1)[0].strip()


def _block_of(lines: list[str], index: int) -> str | None:
    """The feature of the block holding line `index`: the nearest opening line at or above it."""
    for text in reversed(lines[: index + 1]):
        stripped = text.strip()
        if text and not text[0].isspace() and not stripped.startswith("#"):
            return next((kind for pattern, kind in BLOCKS if pattern.match(stripped)), None)
    return None


def _why(message: str) -> str:
    """A diagnostic's message, short enough for a comment: its first line without the step's name (the
    comments name it), cut at a word within 200 characters."""
    first = message.split("\n", 1)[0].removeprefix("the simulated training step ").rstrip(".")
    return first if len(first) <= 200 else first[:200].rsplit(" ", 1)[0] + " ..."
