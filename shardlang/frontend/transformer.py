"""The Lark transformer that turns parses into the syntax nodes of syntax.py, keeping every span.

It runs inside Lark's LALR parser (one callback per reduced rule, no parse tree in between), which
makes parsing a large plan several times faster. The parser keeps every token (`keep_all_tokens`), so
a node's span runs from its first token, keyword included, to its last; the callbacks drop punctuation.
"""

from __future__ import annotations

import re

from lark import Token, Transformer

from . import syntax as s
from .patterns import split_pattern
from .source import Span

#: Tokens that carry a value; all others (keywords, punctuation) only mark positions.
_VALUE_TOKENS = frozenset({"NAME", "DIGIT_NAME", "INT", "NUMBER", "STRING", "PATTERN"})


def _parts(children: list) -> list:
    """The children that mean something: nodes and value tokens, in order."""
    return [c for c in children if not isinstance(c, Token) or c.type in _VALUE_TOKENS]


def _start(item) -> tuple[int, int] | None:
    if isinstance(item, Token):
        return item.line, item.column
    span = getattr(item, "span", None)
    return (span.line, span.col) if span else None


def _end(item) -> tuple[int, int] | None:
    if isinstance(item, Token):
        return item.end_line, item.end_column
    span = getattr(item, "span", None)
    return (span.end_line, span.end_col) if span else None


#: The most digits an integer in a plan may have: no size, count or seed comes near (2**64 has 20).
MAX_DIGITS = 100


class NumberTooLong(Exception):
    """An integer with more than MAX_DIGITS digits: parse reports it as SL102 at `span`."""

    def __init__(self, digits: int, span: Span):
        super().__init__(f"a number of {digits:,} digits; the most a plan takes is {MAX_DIGITS}")
        self.digits, self.span = digits, span


class Build(Transformer):
    """One method per grammar rule, each given the rule's children (all tokens kept) and returning a node.

    `file` names the plan in every span; parse.py sets it before each parse.
    """

    file = "<string>"

    def _cover(self, children: list) -> Span:
        start = next(p for p in map(_start, children) if p)
        end = next(p for p in map(_end, reversed(children)) if p)
        return Span(self.file, start[0], start[1], end[0], end[1])

    def _tok(self, token: Token) -> Span:
        return Span(self.file, token.line, token.column, token.end_line, token.end_column)

    def _name(self, token: Token) -> s.Name:
        return s.Name(token.value, self._tok(token))

    # --- statements ---

    def start(self, children):
        return s.Module(tuple(c for c in children if not isinstance(c, Token)))

    def param_value(self, children):
        return children[0]

    def version(self, children):
        number = self.number([children[1]])
        return s.VersionStmt(number, self._cover(children))

    def param(self, children):
        name, value = _parts(children)
        return s.ParamStmt(self._name(name), value, self._cover(children))

    def use(self, children):
        path, alias = _parts(children)
        return s.UseStmt(path, self._name(alias), self._cover(children))

    def dotted_path(self, children):
        return ".".join(c.value for c in children if c.type == "NAME")

    def string_path(self, children):
        return _unquote(children[0])

    def mesh(self, children):
        name, device, *dims = _parts(children)
        return s.MeshStmt(self._name(name), device, tuple(dims), self._cover(children))

    def mesh_whole(self, children):
        return s.MeshRef(self._name(children[0]), None, self._cover(children))

    def mesh_dim(self, children):
        name, dim = _parts(children)
        return s.MeshRef(self._name(name), (self._name(dim),), self._cover(children))

    def mesh_dims(self, children):
        name, *dims = _parts(children)
        return s.MeshRef(self._name(name), tuple(map(self._name, dims)), self._cover(children))

    def mesh_flat(self, children):
        name, *dims = _parts(children)
        return s.MeshRef(self._name(name), tuple(map(self._name, dims)), self._cover(children), flat=True)

    def parallelize(self, children):
        parts = _parts(children)
        scope = parts[0] if isinstance(parts[0], (s.Pattern, s.ClassTarget)) else None
        mesh = next(p for p in parts if isinstance(p, s.MeshRef))
        rules = tuple(p for p in parts if isinstance(p, s.Rule))
        return s.ParallelizeStmt(scope, mesh, rules, self._cover(children))

    def rule(self, children):
        target, style = _parts(children)
        return s.Rule(target, style, self._cover(children))

    def fully_shard(self, children):
        return self._units("fully_shard", children)

    def replicate(self, children):
        return self._units("replicate", children)

    def _units(self, kind: str, children: list) -> s.UnitsStmt:
        mesh, *items = _parts(children)
        return s.UnitsStmt(kind, mesh, tuple(items), self._cover(children))

    def each(self, children):
        target, *options = _parts(children)
        return s.Each(target, tuple(options), self._cover(children))

    def unit(self, children):
        parts = _parts(children)
        targets = tuple(x for x in parts if not isinstance(x, s.Option))
        options = tuple(x for x in parts if isinstance(x, s.Option))
        return s.UnitItem(targets, options, self._cover(children))

    def option_value(self, children):
        name, value = _parts(children)
        return s.Option(self._name(name), value, None, self._cover(children))

    def option_call(self, children):
        name, *args = _parts(children)
        return s.Option(self._name(name), None, tuple(args), self._cover(children))

    def pipeline(self, children):
        mesh, *items = _parts(children)
        return s.PipelineStmt(mesh, tuple(items), self._cover(children))

    def split_before(self, children):
        return s.SplitBefore(tuple(_parts(children)), self._cover(children))

    def split_into(self, children):
        target, count = _parts(children)
        return s.SplitInto(target, count, self._cover(children))

    def checkpoint(self, children):
        return s.CheckpointStmt(tuple(_parts(children)), self._cover(children))

    def compile(self, children):
        parts = _parts(children)
        targets = tuple(x for x in parts if not isinstance(x, s.Option))
        options = tuple(x for x in parts if isinstance(x, s.Option))
        return s.CompileStmt(targets, options, self._cover(children))

    def init(self, children):
        mode, *method = _parts(children)
        return s.InitStmt(self._name(mode), self._name(method[0]) if method else None, self._cover(children))

    def sync(self, children):
        (mesh,) = _parts(children)
        return s.SyncStmt(mesh, self._cover(children))

    def context_parallel(self, children):
        mesh, *items = _parts(children)
        return s.ContextParallelStmt(mesh, tuple(items), self._cover(children))

    def loss_parallel(self, children):
        return s.LossParallelStmt(self._cover(children))

    def verify(self, children):
        return s.VerifyStmt(tuple(_parts(children)), self._cover(children))

    def call(self, children):
        name, *args = _parts(children)
        return s.Call(self._name(name), tuple(args), self._cover(children))

    value_call = call

    def arg(self, children):
        name, value = _parts(children)
        return s.Arg(self._name(name), value, self._cover(children))

    # --- targets ---

    def pattern(self, children):
        (token,) = children
        segments = tuple(tuple(seg) if isinstance(seg, list) else seg for seg in split_pattern(token.value))
        return s.Pattern(segments, self._tok(token))

    def root(self, children):
        return s.Pattern((), self._cover(children))

    def loss_target(self, children):
        return s.LossTarget(self._cover(children))

    def class_target(self, children):
        return s.ClassTarget(".".join(c.value for c in _parts(children)), self._cover(children))

    # --- values ---

    def name(self, children):
        return self._name(children[0])

    def number(self, children):
        (token,) = children
        if re.fullmatch(r"-?[0-9]+", token.value):
            digits = len(token.value.lstrip("-"))
            if digits > MAX_DIGITS:  # past Python's own limit on int(text) too (4,300 digits)
                raise NumberTooLong(digits, self._tok(token))
            return s.Int(int(token.value), self._tok(token))
        return s.Float(float(token.value), self._tok(token))

    def string(self, children):
        (token,) = children
        return s.Str(_unquote(token), self._tok(token))

    def param_ref(self, children):
        return s.ParamRef(children[1].value, self._cover(children))

    def tuple(self, children):
        return s.Tuple(tuple(_parts(children)), self._cover(children))


def _unquote(token: Token) -> str:
    """The text between the quotes, with `\\x` read as `x`."""
    return re.sub(r"\\(.)", r"\1", token.value[1:-1])
