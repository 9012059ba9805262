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
        assert actual == path.read_text(encoding="utf-8"), (
            f"output differs from {path}; rerun with --update-goldens if intended"
        )

    return check


class Pools:
    """One worker pool per world size for the whole session (spawning a gloo world costs seconds);
    a pool stopped by a failing job is replaced on next use."""

    def __init__(self):
        self._pools = {}

    def __call__(self, world_size: int):
        from shardlang.launch.workers import WorkerPool

        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = WorkerPool(world_size, timeout_s=120)
        return pool

    def close(self):
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def pools():
    pools = Pools()
    yield pools
    pools.close()
