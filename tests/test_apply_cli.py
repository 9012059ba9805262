"""`shardlang apply` end to end: the launcher, the report (text and JSON), exit statuses, workers that
die, every example plan, and a two-node torchrun job on loopback."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

import shardlang
from shardlang.launch.job import Job, run

from .conftest import ROOT
from .test_field import FIELD_PLANS

PLANS = sorted((ROOT / "plans").glob("*.sl"))
HF_PLANS = sorted((ROOT / "plans" / "hf").glob("*.sl"))
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def shardlang_apply(*args, env=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "shardlang", "apply", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def model_of(plan) -> str:
    return re.search(r"Model: (\S+\.py)", plan.read_text()).group(1)


@pytest.mark.parametrize(
    "plan",
    PLANS
    + [
        pytest.param(p, marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs pip install -e '.[hf]'"))
        for p in HF_PLANS
    ]
    + FIELD_PLANS,  # plans/field/ (issue 23): skipped without their extras, known defects marked xfail
    ids=lambda p: p.stem if p.parent.name == "plans" else f"hf-{p.stem}",
)
def test_every_example_plan_passes_its_checks_on_cpu(pools, plan):
    """What `shardlang apply plans/<x>.sl <model> --nproc 4` runs on each rank, on the shared pool."""
    job = Job(str(plan), {}, str(ROOT / model_of(plan)), None, shardlang.load(plan).checks)
    # world 2 (tp 2) for the field plans: nine transformers-sized models at world 4 would double the suite's time
    report = pools(2 if plan.parent.name == "field" else 4).run(run, job)[0]
    assert report.ok, [(c.check, c.message) for c in report.checks] + [str(d.message) for d in report.diagnostics]
    assert {c.check for c in report.ran} == {c.name for c in job.checks}
    # comms is `reported` where the plan gives no counts: it compared nothing, and is not a pass.
    assert all(c.status == "pass" or (c.check, c.status) == ("comms", "reported") for c in report.checks), [
        (c.check, c.status, c.message) for c in report.checks
    ]


def test_readme_main_command_text_report():
    start = time.perf_counter()
    done = shardlang_apply("plans/llama_2d.sl", "examples/llama.py", "--nproc", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.perf_counter() - start < 60
    for check in ("init", "gradients", "module_states", "init_device", "placements"):
        assert re.search(rf"│ {check}\s+│ pass", done.stdout), done.stdout
    assert re.search(r"^5 passed \(", done.stdout, re.MULTILINE), done.stdout
    assert "world 4 on cpu (gloo), 2 replicas x tp 2" in done.stdout
    # The README shows this very output (numbers and the spaces around them aside), with no warning.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    sample = readme.split("The first command prints:\n\n```\n", 1)[1].split("```", 1)[0]

    def shape(text: str) -> str:
        return re.sub(r" +", " ", re.sub(r"\d+(\.\d+)?(e[-+]\d+)?", "N", text)).strip()

    assert shape(sample) == shape(done.stdout), done.stdout
    assert "warning" not in done.stdout + done.stderr


def test_json_report_is_the_only_stdout():
    done = shardlang_apply("plans/mlp_tp.sl", "examples/mlp.py", "--nproc", "2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True and report["world_size"] == 2 and report["device"] == "cpu (gloo)"
    checks = {c["check"]: c for c in report["checks"]}
    assert set(checks) == {"gradients", "placements", "init_device", "module_states", "comms"}
    assert checks["comms"]["data"]["counts"] == {"all_reduce": 1}
    assert all(set(c) == {"check", "status", "ok", "message", "seconds", "data"} for c in report["checks"])
    assert checks["gradients"]["data"]["worst"][0]["tensor"]


def test_failed_check_exits_1_with_sl400(tmp_path):
    plan = tmp_path / "wrong_count.sl"
    plan.write_text(
        "mesh world = cpu[tp=auto]\nparallelize on world.tp { net1 : colwise; net2 : rowwise }\nverify comms(all_reduce=3)\n"
    )
    done = shardlang_apply(str(plan), "examples/mlp.py", "--nproc", "2")
    assert done.returncode == 1
    assert "error[SL400] check comms failed" in done.stdout
    assert "all_reduce: expected 3, counted 1" in done.stdout


def test_unusable_plan_exits_2_before_starting_workers():
    start = time.perf_counter()
    done = shardlang_apply("plans/llama_2d.sl", "examples/mlp.py", "--nproc", "4", "--json")
    assert done.returncode == 2
    report = json.loads(done.stdout)
    assert report["ok"] is False and {d["code"] for d in report["diagnostics"]} == {"SL200"}
    assert time.perf_counter() - start < 20


def test_verify_none_and_steps_override():
    from concurrent.futures import ThreadPoolExecutor

    common = ("plans/mlp_tp.sl", "examples/mlp.py", "--nproc", "2", "--json", "--verify")
    with ThreadPoolExecutor(2) as pool:  # two jobs side by side: the suite's time
        none, steps = pool.map(
            lambda extra: shardlang_apply(*common, *extra), [("none",), ("gradients", "--steps", "1")]
        )
    assert none.returncode == 0 and json.loads(none.stdout)["checks"] == []
    (check,) = json.loads(steps.stdout)["checks"]
    assert check["data"]["steps"] == 1
    done = shardlang_apply("plans/mlp_tp.sl", "examples/mlp.py", "--nproc", "2", "--verify", "gradient")
    assert done.returncode == 2 and "did you mean 'gradients'" in done.stderr


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_a_dying_worker_stops_the_job_and_names_its_rank(how):
    start = time.perf_counter()
    done = shardlang_apply(
        "plans/mlp_tp.sl", "tests/faults/dies.py", "--nproc", "2", env={"SHARDLANG_TEST_FAULT": how}, timeout=120
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr, done.stderr
    if how == "raise":
        assert "shardlang: error: rank 1 failed: " in done.stderr, done.stderr
        assert "planted failure while building on rank 1" in done.stderr
        assert "at tests/faults/dies.py:" in done.stderr  # the user's frame, not shardlang's or torch's
    else:
        assert "shardlang: error: rank 1 died: worker exited with code -9 (killed by signal 9)" in done.stderr
    assert time.perf_counter() - start < 60


def test_two_node_torchrun_job_on_loopback():
    """Two torchrun 'nodes' of 2 processes each on 127.0.0.1: the node with rank 0 prints the report."""
    from shardlang.launch.workers import free_port

    port = str(free_port())
    common = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
    ]
    command = ["-m", "shardlang", "apply", "plans/mlp_tp.sl", "examples/mlp.py", "--device", "cpu", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [*common, "--node-rank", str(n), *command],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:  # a node left waiting for a peer that failed must not outlive the test
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    report = json.loads(outputs[0][0])
    assert report["ok"] and report["world_size"] == 4
    assert outputs[1][0].strip() == ""


def test_library_verify_in_a_process_group(pools):
    from . import dist_jobs

    plan = "mesh world = cpu[tp=auto]\nparallelize on world.tp { net1 : colwise; net2 : rowwise }\nverify gradients, comms(all_reduce=1)\n"
    reports = pools(2).run(dist_jobs.library_verify, plan)
    assert reports[0] == reports[1] == (True, (("gradients", True), ("comms", True)))


def test_abort_during_teardown_after_results_is_a_warning():
    done = shardlang_apply("plans/mlp_tp.sl", "tests/faults/teardown_abort.py", "--nproc", "2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True
    assert "rank 1 exited with code 3 during teardown, after its results arrived" in report["warnings"]
