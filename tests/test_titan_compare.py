"""benchmarks/titan_compare.py (shardlang against torchtitan on torchtitan's own Llama3): its command line
without GPUs, and its fsdp dry run on two CPU workers, which prints the table and a RESULT line with the
same collectives on both sides."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import titan_compare

from .conftest import ROOT


def test_help_needs_no_gpu_and_no_torchtitan(capsys):
    with pytest.raises(SystemExit) as done:
        titan_compare.arguments(["--help"])
    assert done.value.code == 0
    assert "--config" in capsys.readouterr().out


@pytest.mark.distributed
def test_fsdp_dry_run_prints_the_table_and_identical_collectives():
    pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install -e '.[titan]'")
    from shardlang.launch.workers import free_port

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "benchmarks/titan_compare.py",
        "--config",
        "fsdp",
        "--dry-run",
        "--steps",
        "2",
        "--warmup",
        "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("fsdp (dp 2 x tp 1), eager, tiny (dry run)"), done.stdout
    assert [line.split()[0] for line in lines[2:4]] == ["shardlang", "torchtitan"]
    assert any(line.startswith("collectives of one forward+backward: identical on every rank") for line in lines)
    result = json.loads(next(line for line in lines if line.startswith("RESULT "))[len("RESULT ") :])
    assert result["config"] == "fsdp" and result["world"] == 2 and result["counts_identical"]
    counts = result["counts"]
    assert counts["shardlang"] == counts["torchtitan"]
    # FSDP's own collectives: an all-gather per unit in the forward and per block again in the backward.
    assert (
        counts["shardlang"].get("_allgather_base_", 0) > 0 and counts["shardlang"].get("_reduce_scatter_base_", 0) > 0
    )
    for side in ("shardlang", "torchtitan"):
        assert result[side]["median_s"] > 0 and result[side]["tokens_per_s"] > 0


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("name", "world"),
    [("fsdp", 2), ("tp_sp", 2), ("tp_fsdp", 4), ("fsdp_compile_loss", 2)],
    ids=lambda x: str(x),
)
def test_the_benchmarks_plans_pass_their_checks_on_the_same_model_class(pools, name, world):
    """Each plan the benchmark times, applied with its own checks to torchtitan's Llama3 of the benchmark's
    dry-run size (the 1B's class and tying, benchmarks/titan_1b_tiny.py): what is timed is also right."""
    pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install -e '.[titan]'")
    import shardlang
    from shardlang.launch.job import Job, run

    plan = ROOT / "benchmarks" / "plans" / f"titan_1b_{name}.sl"
    params = {"backend": "aot_eager"} if "_compile" in name else {}
    checks = shardlang.load(plan, params=params).checks
    job = Job(str(plan), params, str(ROOT / "benchmarks" / "titan_1b_tiny.py"), None, checks)
    report = pools(world).run(run, job)[0]
    assert report.ok and {c.check for c in report.ran} == {c.name for c in checks}, [
        (c.check, c.status, c.message) for c in report.checks
    ]
