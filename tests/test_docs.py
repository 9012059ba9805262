"""The documentation holds together: docs/diagnostics.md's table is the `Code` enum word for word, the
README stays a front door, every relative link and anchor resolves, every plan named exists, and the
repository stands alone (no document that readers do not have). No process group, no torch import."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardlang.frontend.diagnostics import Code

from .conftest import ROOT

DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
ROW = re.compile(r"^\| (SL\d{3}) \| (error|warning) \| (.*) \|$")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (links and headings inside them are not links or headings)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def test_the_code_table_is_the_code_enum():
    rows = [ROW.match(line) for line in _text(DOCS / "diagnostics.md").splitlines()]
    table = [(m[1], m[2], m[3]) for m in rows if m]
    enum = [(code.name, code.severity.value, code.meaning) for code in Code]
    expected = "\n".join(f"| {name} | {severity} | {meaning} |" for name, severity, meaning in enum)
    assert table == enum, "docs/diagnostics.md's table should read:\n" + expected


def test_there_is_one_table_of_codes():
    for page in PAGES:
        if page.name != "diagnostics.md":
            rows = [line for line in _text(page).splitlines() if re.match(r"^\| SL\d{3} \|", line)]
            assert not rows, f"{page.relative_to(ROOT)} has its own table of codes: link docs/diagnostics.md"


def test_every_code_is_described():
    text = _text(DOCS / "diagnostics.md").split("## What each code covers", 1)[1]
    assert [c.name for c in Code] == re.findall(r"^- \*\*(SL\d{3})\*\*", text, re.MULTILINE)


def test_readme_is_a_front_door():
    lines = _text(ROOT / "README.md").splitlines()
    assert len(lines) <= 300, len(lines)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(_text(path)), re.MULTILINE):
        slug = _slug(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(_text(page))):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        assert path.exists(), f"{page.relative_to(ROOT)}: {target} is not a file"
        assert ROOT.resolve() in path.parents or path == ROOT.resolve(), f"{page.relative_to(ROOT)}: {target}"
        if anchor:
            assert path.suffix == ".md" and anchor in _anchors(path), f"{page.relative_to(ROOT)}: no anchor {target}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_stands_alone(page):
    text = _text(page)
    assert "../shared" not in text and "shared/" not in text
    assert not re.search(r"\bSPEC\b", text), f"{page.relative_to(ROOT)} names a SPEC readers do not have"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_plans_and_examples_named_exist(page):
    names = set(re.findall(r"\b((?:plans|examples)/[\w/.-]+\.(?:sl|py))\b", _text(page)))
    missing = sorted(name for name in names if not (ROOT / name).exists())
    assert not missing, f"{page.relative_to(ROOT)} names {missing}"


def test_architecture_gives_the_layer_order_of_test_layout():
    from .test_layout import STAGES

    line = next(line for line in _text(DOCS / "architecture.md").splitlines() if line.startswith("Layer order:"))
    named = re.findall(r"`([\w]*)`", line)
    assert named == [stage or "__init__" for stage in STAGES]
