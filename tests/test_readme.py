"""The README's library snippets run as written (issue 40: one used an undefined name and rebound `plan`,
so its commented results did not come out), and print what their comments say."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from .conftest import ROOT

#: `print(...)  # what it prints` in a snippet: the comment's first word, up to an ellipsis or a note in brackets.
PRINTS = re.compile(r"^[ \t]*print\(.*\)[ \t]+# (.+?)(?:\.\.\.|[ \t]+\(|$)", re.MULTILINE)


def _library_snippets() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return "\n".join(re.findall(r"```python\n(.*?)```", text[text.index("## Library") :], re.DOTALL))


@pytest.mark.distributed
def test_the_readmes_library_snippets_print_what_their_comments_say(tmp_path):
    snippets = _library_snippets()
    script = tmp_path / "snippets.py"
    script.write_text(snippets)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = [e.strip() for e in PRINTS.findall(snippets)]
    assert len(expected) == 6, expected
    printed = iter(done.stdout.splitlines())
    for want in expected:  # in order: each commented print's output starts as its comment says
        assert any(line.startswith(want) for line in printed), (want, done.stdout)
