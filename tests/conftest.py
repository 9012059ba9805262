"""Shared test options: `--update-goldens` rewrites expected-output files instead of comparing with them."""

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).parent.parent


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", help="rewrite golden files from the current output")


@pytest.fixture
def golden(request):
    """Compare text with a golden file, or (with --update-goldens) write it."""
    update = request.config.getoption("--update-goldens")

    def check(path: Path, actual: str) -> None:
        if update or not path.exists():
            path.write_text(actual, encoding="utf-8")
            if not update:
                pytest.fail(f"golden file {path.name} was missing and has been written; check it and run again")
            return
        assert actual == path.read_text(encoding="utf-8"), f"output differs from {path}; rerun with --update-goldens if intended"

    return check
