"""benchmarks/titan_compare.py (shardlang against torchtitan on torchtitan's own Llama3 and Qwen3-MoE): its
command line without GPUs, and its fsdp and ep dry runs on two CPU workers, which print the table and a
RESULT line with the same collectives on both sides."""

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


def _dry_run(config: str) -> tuple[list[str], dict]:
    """`titan_compare.py --config CONFIG --dry-run` on two CPU workers: its printed lines and RESULT."""
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
        config,
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
    return lines, json.loads(next(line for line in lines if line.startswith("RESULT "))[len("RESULT ") :])


@pytest.mark.distributed
def test_fsdp_dry_run_prints_the_table_and_identical_collectives():
    pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install -e '.[titan]'")
    lines, result = _dry_run("fsdp")
    assert lines[0].startswith("fsdp (dp 2 x tp 1), eager, tiny (dry run)"), lines
    assert [line.split()[0] for line in lines[2:4]] == ["shardlang", "torchtitan"]
    assert any(line.startswith("collectives of one forward+backward: identical on every rank") for line in lines)
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
def test_ep_dry_run_trains_torchtitans_moe_alike_on_both_sides():
    """--config ep: torchtitan's Qwen3-MoE under its own EP (its all-to-all dispatcher) and under the plan's
    expert_parallel on its grouped experts, torchtitan's model given shardlang's weights: the same loss at
    the first step, bitwise (the same routing, the same sums), and the same collectives in kind and number
    (per layer the counts' all-to-all and two of the rows each way, 2 layers)."""
    pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install -e '.[titan]'")
    lines, result = _dry_run("ep")
    assert lines[0].startswith("ep (dp 2 x tp 1), eager, tiny (dry run)"), lines
    losses = result["first_loss"]
    assert losses["shardlang"] == losses["torchtitan"], losses
    assert result["counts_identical"], result["counts_per_rank"]
    assert titan_compare.kinds(result["counts"]["shardlang"])["all_to_all_single"] == 2 * (1 + 2 * 2)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("size", "name", "world"),
    [
        ("1b", "fsdp", 2),
        ("1b", "tp_sp", 2),
        ("1b", "tp_fsdp", 4),
        ("1b", "fsdp_compile_loss", 2),
        ("8b", "fsdp", 2),
        ("8b", "tp_fsdp", 4),
    ],
    ids=lambda x: str(x),
)
def test_the_benchmarks_plans_pass_their_checks_on_the_same_model_class(pools, size, name, world):
    """Each plan the benchmark times, applied with its own checks to torchtitan's Llama3 of the benchmark's
    dry-run size (the 1B's class and tying, benchmarks/titan_1b_tiny.py; the 8B's untied embedding,
    titan_8b_tiny.py): what is timed is also right."""
    pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install -e '.[titan]'")
    import shardlang
    from shardlang.launch.job import Job, run

    plan = ROOT / "benchmarks" / "plans" / f"titan_{size}_{name}.sl"
    params = {"backend": "aot_eager"} if "_compile" in name else {}
    checks = shardlang.load(plan, params=params).checks
    job = Job(str(plan), params, str(ROOT / "benchmarks" / f"titan_{size}_tiny.py"), None, checks)
    report = pools(world).run(run, job)[0]
    assert report.ok and {c.check for c in report.ran} == {c.name for c in checks}, [
        (c.check, c.status, c.message) for c in report.checks
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("ep", [2, 4])
def test_the_moe_benchmarks_plan_passes_its_checks_on_the_same_model_class(pools, ep):
    """benchmarks/plans/titan_moe_ep.sl on torchtitan's Qwen3-MoE of the dry run's size (8 experts, top 2,
    benchmarks/titan_moe_tiny.py): every check passes, the all-to-alls counted."""
    pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install -e '.[titan]'")
    import shardlang
    from shardlang.launch.job import Job, run

    plan = ROOT / "benchmarks" / "plans" / "titan_moe_ep.sl"
    params = {"ep": str(ep)}  # titan_compare's --ep: EP 4 on 4 of the tiny model's 8 experts
    checks = shardlang.load(plan, params=params).checks
    job = Job(str(plan), params, str(ROOT / "benchmarks" / "titan_moe_tiny.py"), None, checks)
    report = pools(ep).run(run, job)[0]
    assert report.ok and {c.check for c in report.ran} == {c.name for c in checks}, [
        (c.check, c.status, c.message) for c in report.checks
    ]
    comms = next(c for c in report.ran if c.check == "comms")
    assert "all_to_all_single=8, alltoall_base_=2" in comms.message, comms.message
