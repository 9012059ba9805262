"""Byte-level mutations of every example plan, through the command line in this process: `lint`, `lint`
with the plan's model and `compile`. Whatever the bytes, main returns 0, 1 or 2 and prints diagnostics
or a usage error; no exception escapes it (issue 13). Seeded, so a failure repeats: 8 mutations of each plan
in the fast lane (about 5 s here), more with SHARDLANG_CLI_FUZZ_PER_PLAN=N (40 took 30 s)."""

from __future__ import annotations

import contextlib
import io
import os
import random
import re

import pytest

from shardlang.cli import main

from .conftest import ROOT

PLANS = sorted((ROOT / "plans").glob("*.sl")) + sorted((ROOT / "plans" / "seeds").glob("*.sl"))
PER_PLAN = int(os.environ.get("SHARDLANG_CLI_FUZZ_PER_PLAN", 8))
#: Bytes a mutation inserts: the plan language's own punctuation, digits, letters, and hostile ones.
ALPHABET = b"{}()[]=:,.;*$#\"'\\_-+/ \n\t0123456789azAZ" + bytes([0, 0x80, 0xC3, 0xFF, 0xE2])


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to four byte-level edits: flip, insert, delete, duplicate a slice, truncate, splice."""
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(data) + 1)
        op = rng.choice(("flip", "insert", "delete", "duplicate", "truncate", "swap"))
        if op == "flip" and i < len(data):
            data[i] ^= 1 << rng.randrange(8)
        elif op == "insert":
            data[i:i] = bytes(rng.choice(ALPHABET) for _ in range(rng.randint(1, 3)))
        elif op == "delete":
            del data[i : i + rng.randint(1, 16)]
        elif op == "duplicate":
            data[i:i] = data[i : i + rng.randint(1, 64)]
        elif op == "truncate":
            del data[i:]
        elif op == "swap" and len(data) > 1:
            j = rng.randrange(len(data))
            data[i : i + 1], data[j : j + 1] = data[j : j + 1], data[i : i + 1]
    return bytes(data)


def run(args: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(args)  # an exception escaping main fails the test with its traceback
    return status, out.getvalue() + err.getvalue()


def _forks(plan) -> list:
    """A plan declaring `use` styles: lint predicts their placements in a forked child (a fake process group)."""
    return [pytest.mark.distributed] if re.search(r"^use ", plan.read_text(), re.MULTILINE) else []


@pytest.mark.parametrize("plan", [pytest.param(p, marks=_forks(p)) for p in PLANS], ids=lambda p: p.stem)
def test_mutated_plans_give_diagnostics_not_tracebacks(plan, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    model = re.search(r"Model: (\S+\.py)", plan.read_text()).group(1)
    rng = random.Random(f"shardlang-13-{plan.name}")
    original = plan.read_bytes()
    target = tmp_path / "mutated.sl"
    for n in range(PER_PLAN):
        data = mutate(original, rng)
        target.write_bytes(data)
        commands = (
            ["lint", str(target), "--world", "8"],
            ["lint", str(target), model, "--world", "8", "--no-step"],  # the step: tests/test_lint.py
            ["compile", str(target), "--world", "8", "--emit", "python"],
        )
        for args in commands:
            status, text = run(args)
            case = f"mutation {n} of {plan.name} ({data[:200]!r}...), shardlang {' '.join(args)}"
            assert status in (0, 1, 2), case
            assert "Traceback" not in text, case
            if status == 2:
                assert "error" in text, case
