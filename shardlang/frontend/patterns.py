"""Module patterns as plain functions: split, match by regex or by class, and order units.

The resolver matches a plan's targets with these, and `compile --emit python` pastes their source
into a program lowered without a model, which matches the same targets when it runs. So each uses only
the standard library and the other functions here.
"""

from __future__ import annotations

import re


def split_pattern(pattern):
    """`attention.{wq, wk}.weight` -> ["attention", ["wq", "wk"], "weight"]: dotted segments, an
    alternation as the list of its options."""
    import re

    return [
        [option.strip() for option in segment[1:-1].split(",")] if segment.startswith("{") else segment
        for segment in re.findall(r"\{[^{}]*\}|[^.{}]+", pattern)
    ]


def pattern_regex(pattern):
    """A module pattern as a regex over FQNs written with a dot before each segment (`.layers.0`; the
    model itself is ``), so that `**` can match no segment at all. `*` is one segment, `**` any number,
    `w*` and `layer?` are globs inside a segment, `{a,b}` an alternation, `root` the model itself."""
    import re

    if pattern == "root":
        return re.compile("")
    parts = []
    for segment in split_pattern(pattern):
        if segment == "**":
            parts.append(r"(?:\.[^.]+)*")
            continue
        options = segment if isinstance(segment, list) else [segment]
        globs = [
            "[^.]+"
            if option == "*"
            else "".join("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c) for c in option)
            for option in options
        ]
        parts.append(r"\.(?:" + "|".join(globs) + ")")
    return re.compile("".join(parts))


def class_matches(name, cls):
    """`class Linear`, `class torch.nn.Linear` (a public re-export) or `class torch.nn.modules.linear.Linear`."""
    *package, base = name.split(".")
    if base not in (cls.__name__, cls.__qualname__):
        return False
    prefix, module = ".".join(package), cls.__module__
    return not prefix or module == prefix or module.startswith(prefix + ".") or module.endswith("." + prefix)


def modules_matching(model, target):
    """FQNs (relative to `model`) of the submodules a target matches: a pattern, `root` or `class NAME`."""
    if target.startswith("class "):
        name = target[len("class ") :].strip()
        return [fqn for fqn, module in model.named_modules() if class_matches(name, type(module))]
    regex = pattern_regex(target)
    return [fqn for fqn, _ in model.named_modules() if regex.fullmatch("." + fqn if fqn else "")]


def within(inner, outer):
    """Whether module `inner` is `outer` or inside it (every module is inside the root, '')."""
    return not outer or inner == outer or inner.startswith(outer + ".")


def depth(fqn):
    """How deep a module sits: 0 for the model, 1 for its children..."""
    return fqn.count(".") + 1 if fqn else 0


def named_units_win(matches):
    """Drop a unit that a `class` target picked where a unit of the other kind names the same module
    by pattern, as FSDP's auto-wrap policy skips modules that replicate manages. `matches` are
    (module FQN, "fully_shard" or "replicate", picked by class?, anything) tuples."""
    other = {"fully_shard": "replicate", "replicate": "fully_shard"}
    named = {(fqn, kind) for fqn, kind, by_class, _ in matches if not by_class}
    return [m for m in matches if not (m[2] and (m[0], other[m[1]]) in named)]


#: A pattern segment: a name, an integer, `**`, or a glob.
SEGMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|\*\*|[A-Za-z0-9_?]*[*?][A-Za-z0-9_?]*(?:\*[A-Za-z0-9_?]*)*")


def bad_segment(segments) -> str | None:
    """The first of a pattern's segments that is not a name, an integer, a glob, `**` or an alternation of
    those (the static checks' SL102)."""
    for segment in segments:
        for part in (segment,) if isinstance(segment, str) else segment:
            if (
                not SEGMENT.fullmatch(part)
                or (part != "**" and "**" in part)
                or (part == "**" and not isinstance(segment, str))
            ):
                return part or "{}" if isinstance(segment, str) else "{" + ",".join(segment) + "}"
    return None


#: Module names that wrappers insert into a model's module and state-dict names (activation checkpointing's,
#: FSDP1's, torch.compile's), which the unsharded model and a checkpoint's keys do not have.
WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"})


def plain_name(name: str) -> str:
    """A module's or a state-dict key's dotted name without the segments wrappers insert, as the unsharded
    model names it and as torch's get_model_state_dict keys it."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def starred(name: str) -> str:
    """`name` with each integer segment as `*` (layers.0.attention.wq -> layers.*.attention.wq; a
    Sequential's 0.weight -> *.weight): the same tensor in every block."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)
