"""Plan source text and the spans that point into it."""

from __future__ import annotations

from attrs import frozen

#: Plans larger than this are rejected before parsing (docs/language.md §3).
MAX_PLAN_BYTES = 1 << 20


@frozen
class Span:
    """A region of a plan file. Lines and columns count from 1; `end_col` is one past the last character."""

    file: str
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    def short(self) -> str:
        """`line:col-end_line:end_col`, the form the golden IR dumps use."""
        return f"{self.line}:{self.col}-{self.end_line}:{self.end_col}"


@frozen
class Source:
    """One plan's text and the name diagnostics call it by (a path as the user wrote it, or `<string>`)."""

    name: str
    text: str

    def line_text(self, line: int) -> str:
        lines = self.text.splitlines()
        return lines[line - 1] if 0 < line <= len(lines) else ""

    def span(self, line: int, col: int, end_line: int | None = None, end_col: int | None = None) -> Span:
        return Span(self.name, line, col, end_line or line, end_col or col + 1)

    def span_at(self, offset: int, length: int = 1) -> Span:
        """The span of `length` characters starting at character `offset`."""
        line = self.text.count("\n", 0, offset) + 1
        col = offset - (self.text.rfind("\n", 0, offset) + 1) + 1
        return Span(self.name, line, col, line, col + max(length, 1))
