"""Plan text -> syntax tree. Lark parse errors become SL100/SL101 diagnostics with the expected tokens."""

from __future__ import annotations

import functools
import re
import threading
from importlib import resources
from pathlib import Path

import attrs
from lark import Lark, Token
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken
from lark.lexer import PatternStr

from . import syntax
from .diagnostics import SL100, SL101, SL102, Diagnostic, did_you_mean
from .source import MAX_PLAN_BYTES, Source, Span
from .transformer import Build, NumberTooLong

#: Words that start a statement, for "did you mean" and for finding where to resume after an error.
STATEMENT_KEYWORDS = (
    "shardlang",
    "param",
    "use",
    "mesh",
    "parallelize",
    "fully_shard",
    "replicate",
    "checkpoint",
    "compile",
    "init",
    "sync",
    "loss_parallel",
    "verify",
    "pipeline",
)

#: After this many syntax errors the parser stops looking for more.
MAX_SYNTAX_ERRORS = 10

#: Words that are keywords where the grammar expects them; each is the terminal of its upper-case name.
KEYWORDS = (*STATEMENT_KEYWORDS, "on", "as", "each", "unit", "with", "over", "root", "class", "split", "before", "into")
_KEYWORD_TERMINALS = {word.upper(): word for word in KEYWORDS}

_RESUME = re.compile(r"^[ \t]*(?:{})\b".format("|".join(STATEMENT_KEYWORDS)), re.MULTILINE)

_TERMINAL_WORDS = {
    "NAME": "a name",
    "INT": "an integer",
    "NUMBER": "a number",
    "PATTERN": "a module pattern",
    "STRING": "a string",
    "$END": "end of file",
}


def grammar_path() -> Path:
    """The grammar inside the installed wheel, or in the source checkout's `grammar/` folder."""
    packaged = resources.files("shardlang").joinpath("grammar", "shardlang.lark")
    if packaged.is_file():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "grammar" / "shardlang.lark"


_BUILD = Build()
#: Guards `_BUILD.file` for the length of one parse.
_LOCK = threading.Lock()


@functools.cache
def _lark() -> Lark:
    return Lark(
        grammar_path().read_text(encoding="utf-8"),
        parser="lalr",
        lexer="contextual",
        transformer=_BUILD,
        keep_all_tokens=True,
        maybe_placeholders=False,
        start=["start", "param_value"],
    )


def _run(text: str, name: str, start: str):
    with _LOCK:
        _BUILD.file = name
        return _lark().parse(text, start=start)


def decode(name: str, data: bytes) -> tuple[Source | None, list[Diagnostic]]:
    """Bytes of a plan file -> Source, or SL102 for a file over 1 MiB or one that is not UTF-8."""
    if len(data) > MAX_PLAN_BYTES:  # read_file reads at most one byte more than the limit
        return None, [_too_large(name, None)]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        before = Source(name, data[: e.start].decode("utf-8"))
        message = f"plan file is not UTF-8: byte 0x{data[e.start]:02x} cannot be decoded"
        return None, [Diagnostic(SL102, message, before.span_at(len(before.text)))]
    return Source(name, text.removeprefix("\ufeff")), []


def parse(source: Source) -> tuple[syntax.Module | None, list[Diagnostic]]:
    """Parse a whole plan. On syntax errors, resume at the next statement to report up to ten of them."""
    size = len(source.text.encode("utf-8", "surrogatepass"))
    if size > MAX_PLAN_BYTES:
        return None, [_too_large(source.name, size)]
    text, resumed_at, diagnostics = source.text, -1, []
    while len(diagnostics) < MAX_SYNTAX_ERRORS:
        try:
            module = _run(text, source.name, "start")
        except NumberTooLong as e:  # a value no plan means, too long even to convert: not parsed further
            return None, [*diagnostics, Diagnostic(SL102, str(e), e.span, label="too long")]
        except UnexpectedInput as e:
            diagnostics.append(_syntax_error(e, source))
            at_end = isinstance(e, UnexpectedToken) and e.token.type == "$END" or e.pos_in_stream is None
            resume = None if at_end else _resume_offset(source.text, max(e.pos_in_stream + 1, resumed_at + 1))
            if resume is None:
                break
            # Blank out what came before, keeping newlines, so that positions stay true.
            text, resumed_at = re.sub(r"[^\n]", " ", source.text[:resume]) + source.text[resume:], resume
            continue
        if diagnostics:
            break
        return module, []
    return None, diagnostics


def parse_value(text: str, origin: str) -> syntax.Value | None:
    """A value written outside a plan, e.g. `-D tp=4`; None when it is not one (the caller takes it as a string)."""
    try:
        return _run(text, origin, "param_value")
    except (UnexpectedInput, NumberTooLong):
        return None


def parse_literal(value, span: Span) -> syntax.Value:
    """A Python value given for a param (library `params=` or CLI `-D`) as a syntax value at `span`."""
    if isinstance(value, bool):
        return syntax.Name("true" if value else "false", span)
    if isinstance(value, int):
        return syntax.Int(value, span)
    if isinstance(value, float):
        return syntax.Float(value, span)
    if isinstance(value, str):
        parsed = parse_value(value, span.file)
        return attrs.evolve(parsed, span=span) if parsed is not None else syntax.Str(value, span)
    return syntax.Str(str(value), span)


def _token_span(source: Source, token: Token) -> Span:
    return source.span(token.line, token.column, token.end_line, token.end_column)


def _too_large(name: str, size: int | None) -> Diagnostic:
    what = f"{size:,} bytes" if size is not None else f"over {MAX_PLAN_BYTES:,} bytes"
    message = f"plan file is {what}; the limit is {MAX_PLAN_BYTES:,} (1 MiB)"
    return Diagnostic(SL102, message, Source(name, "").span(1, 1))


def _resume_offset(text: str, start: int) -> int | None:
    match = _RESUME.search(text, start)
    return match.start() if match else None


def _syntax_error(e: UnexpectedInput, source: Source) -> Diagnostic:
    expectation = _expectation(getattr(e, "expected", None) or getattr(e, "allowed", None) or set())
    if isinstance(e, UnexpectedToken) and e.token.type != "$END":
        unknown = _unknown_keyword(e)
        if unknown is not None:
            token, message, hint = unknown
            return Diagnostic(SL101, message, _token_span(source, token), hint, label="unknown here")
        token = e.token
        span = _token_span(source, token)
        return Diagnostic(SL100, f"unexpected {_show(token)}; {expectation}", span, label=expectation)
    if isinstance(e, UnexpectedCharacters):
        span = source.span(e.line, e.column)
        char = source.text[e.pos_in_stream]
        return Diagnostic(SL100, f"unexpected character {char!r}; {expectation}", span, label="here")
    end = source.span_at(len(source.text.rstrip()))
    unclosed = ("a block is still open: is a '}' missing?",) if "RBRACE" in getattr(e, "expected", ()) else ()
    return Diagnostic(SL100, f"unexpected end of file; {expectation}", end, unclosed, label=expectation)


#: Sets of terminals that read better as one phrase in "expected ..." messages.
_GROUPS = (
    ({"PATTERN"}, {"PATTERN", "ROOT", "CLASS"}, "a module pattern"),
    ({"NUMBER", "STRING", "DOLLAR"}, {"NAME", "NUMBER", "STRING", "DOLLAR", "LPAR"}, "a value"),
)


def _expectation(expected: set[str]) -> str:
    """`expected X` in words: a statement, a module pattern and a value stand for their many first tokens."""
    expected = set(expected)
    phrases = []
    statements = {word.upper() for word in STATEMENT_KEYWORDS}
    if statements <= expected:
        expected -= statements
        phrases.append("a statement")
    for trigger, members, phrase in _GROUPS:
        if trigger <= expected:
            expected -= members
            phrases.append(phrase)
    if len(expected) > 1 or phrases:
        expected.discard("SEMICOLON")
    phrases += sorted(_describe(t) for t in expected)
    if not phrases:
        return "expected nothing more"
    return "expected " + (phrases[0] if len(phrases) == 1 else "one of: " + ", ".join(phrases))


def _unknown_keyword(e: UnexpectedToken) -> tuple[Token, str, tuple[str, ...]] | None:
    """A word where only keywords may stand (an unknown statement, a misspelt `on`), or a misspelt keyword
    that was read as a name and made the next token unexpected (`eahc layers.*`)."""
    token = e.token
    if token.type in ("NAME", "PATTERN") and token.value.isidentifier():
        keywords = [_KEYWORD_TERMINALS[t] for t in e.expected if t in _KEYWORD_TERMINALS]
        if set(STATEMENT_KEYWORDS) <= set(keywords):
            hint = did_you_mean(token.value, STATEMENT_KEYWORDS)
            return (
                token,
                f"unknown statement '{token.value}'",
                hint or ("a statement starts with " + _join(STATEMENT_KEYWORDS),),
            )
        hint = did_you_mean(token.value, keywords)
        if hint:
            return token, f"unknown keyword '{token.value}'", hint
    stack = e.interactive_parser.parser_state.value_stack if e.interactive_parser else []
    previous = stack[-1] if stack else None
    if isinstance(previous, Token) and previous.type == "NAME":
        hint = did_you_mean(previous.value, KEYWORDS)
        if hint and previous.value not in KEYWORDS:
            return previous, f"unknown keyword '{previous.value}'", hint
    return None


@functools.cache
def _patterns():
    return {t.name: t.pattern for t in _lark().terminals}


def _describe(terminal: str) -> str:
    if terminal in _KEYWORD_TERMINALS:
        return f"'{_KEYWORD_TERMINALS[terminal]}'"
    pattern = _patterns().get(terminal)
    if isinstance(pattern, PatternStr):
        return f"'{pattern.value}'"
    return _TERMINAL_WORDS.get(terminal, terminal.lower())


def _show(token: Token) -> str:
    """A token as the user sees it: by its shape, whichever terminal the lexer took it for."""
    value = token.value
    if value.isidentifier():
        return f"name '{value}'"
    if re.fullmatch(r"-?[0-9.]+(e[-+]?[0-9]+)?", value, re.IGNORECASE):
        return f"number '{value}'"
    if token.type in ("PATTERN", "STRING"):
        return f"{_describe(token.type).split(' ', 1)[1]} {value!r}"
    return repr(value)


def _join(words) -> str:
    words = [f"'{w}'" for w in words]
    return ", ".join(words[:-1]) + " or " + words[-1]
