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

from .conftest import ROOT, shardlang_cli
from .test_field import FIELD_PLANS

pytestmark = pytest.mark.distributed  # `shardlang apply` starts workers (one test here only names frames)

PLANS = sorted((ROOT / "plans").glob("*.sl"))
HF_PLANS = sorted((ROOT / "plans" / "hf").glob("*.sl"))
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def shardlang_apply(*args, env=None):
    return shardlang_cli("apply", *args, env=env)


@pytest.fixture(scope="module")
def applied():
    """`shardlang_apply(*args, env=...)`, run once per distinct command in this module: the tests that
    read one job's text and its JSON share the run (each run starts a launcher and workers, all importing torch).
    """
    done = {}

    def get(*args, env=None):
        key = (args, tuple(sorted((env or {}).items())))
        if key not in done:
            done[key] = shardlang_apply(*args, env=env)
        return done[key]

    return get


def model_of(plan) -> str:
    return re.search(r"Model: (\S+\.py)", plan.read_text()).group(1)


#: Every example plan, as the every-plan test applies it (and tests/test_lint_step.py lints it, at the same world).
EXAMPLE_PLANS = (
    PLANS
    + [
        pytest.param(p, marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs pip install -e '.[hf]'"))
        for p in HF_PLANS
    ]
    + FIELD_PLANS  # plans/field/ (issue 23): skipped without their extras, known defects marked xfail
)


def example_id(plan) -> str:
    return plan.stem if plan.parent.name == "plans" else f"hf-{plan.stem}"


def world_of(plan) -> int:
    """The world an example plan is applied at: 2 (tp 2) for the field plans, whose nine transformers-sized
    models at world 4 would double the suite's time; 4 for the others."""
    return 2 if plan.parent.name == "field" else 4


@pytest.mark.parametrize("plan", EXAMPLE_PLANS, ids=example_id)
def test_every_example_plan_passes_its_checks_on_cpu(pools, plan):
    """What `shardlang apply plans/<x>.sl <model> --nproc 4` runs on each rank, on the shared pool."""
    job = Job(str(plan), {}, str(ROOT / model_of(plan)), None, shardlang.load(plan).checks)
    report = pools(world_of(plan)).run(run, job)[0]
    assert report.ok, [(c.check, c.message) for c in report.checks] + [str(d.message) for d in report.diagnostics]
    assert {c.check for c in report.ran} == {c.name for c in job.checks}
    # comms is `reported` where the plan gives no counts: it compared nothing, and is not a pass.
    assert all(c.status == "pass" or (c.check, c.status) == ("comms", "reported") for c in report.checks), [
        (c.check, c.status, c.message) for c in report.checks
    ]


def test_readme_main_command_text_report():
    done = shardlang_apply("plans/llama_2d.sl", "examples/llama.py", "--nproc", "4")
    assert done.returncode == 0, done.stdout + done.stderr
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
    # and is one run's: the table's worst gradient error is the one the message below it gives
    table = float(re.search(r"│ gradients\s+│ pass\s+│\s+(\S+) │", sample).group(1))
    assert f"worst {table:.2f} of the allowed error" in sample


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
    assert report["exit_status"] == 0 and report["failure"] is None and report["ranks"] == []


def test_failed_check_exits_1_with_sl400(tmp_path):
    plan = tmp_path / "wrong_count.sl"
    plan.write_text(
        "mesh world = cpu[tp=auto]\nparallelize on world.tp { net1 : colwise; net2 : rowwise }\nverify comms(all_reduce=3)\n"
    )
    done = shardlang_apply(str(plan), "examples/mlp.py", "--nproc", "2")
    assert done.returncode == 1
    assert "error[SL400] check comms failed" in done.stdout
    assert "all_reduce: expected 3, counted 1" in done.stdout


def test_unusable_plan_exits_2_before_starting_workers(capsys, monkeypatch):
    """In this process, with starting a process refused: no worker is started (not: it was quick)."""
    import multiprocessing.process

    from shardlang.cli import main

    started = []
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", lambda self: started.append(self) or 1 / 0)
    monkeypatch.chdir(ROOT)
    status = main(["apply", "plans/llama_2d.sl", "examples/mlp.py", "--nproc", "4", "--json"])
    assert status == 2 and started == []
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and {d["code"] for d in report["diagnostics"]} == {"SL200"}


def test_more_ranks_than_gpus_on_cuda_exits_2_before_starting_workers(capsys, monkeypatch):
    """Local workers take a GPU each: 4 ranks on a machine of 2 GPUs are refused, saying so, before any
    worker starts (they died with CUDA's 'invalid device ordinal')."""
    import multiprocessing.process

    import torch

    from shardlang.cli import main

    started = []
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", lambda self: started.append(self) or 1 / 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.chdir(ROOT)
    status = main(["apply", "plans/llama_2d.sl", "examples/llama.py", "--nproc", "4", "--device", "cuda"])
    assert status == 2 and started == []
    assert "4 ranks on cuda need 4 GPUs, one each, and this machine has 2" in capsys.readouterr().err


def test_verify_none_and_steps_override():
    common = ("plans/mlp_tp.sl", "examples/mlp.py", "--nproc", "2", "--json", "--verify")
    none = shardlang_apply(*common, "none")
    assert none.returncode == 0 and json.loads(none.stdout)["checks"] == []
    steps = shardlang_apply(*common, "gradients", "--steps", "1")
    (check,) = json.loads(steps.stdout)["checks"]
    assert check["data"]["steps"] == 1
    done = shardlang_apply(*common[:4], "--verify", "gradient")
    assert done.returncode == 2 and "did you mean 'gradients'" in done.stderr


DIES = ("plans/mlp_tp.sl", "tests/faults/dies.py", "--nproc", "2")


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_a_dying_worker_stops_the_job_and_names_its_rank(applied, how):
    # Bounded: a job that did not stop would run into the timeout. The kill's run is also the JSON test's
    # (main prints the same line on stderr with --json).
    done = applied(*DIES, *(["--json"] if how == "kill" else []), env={"SHARDLANG_TEST_FAULT": how})
    assert done.returncode == 2
    assert "Traceback" not in done.stderr, done.stderr
    if how == "raise":
        assert "shardlang: error: rank 1 failed: " in done.stderr, done.stderr
        assert "planted failure while building on rank 1" in done.stderr
        assert "at tests/faults/dies.py:" in done.stderr  # the user's frame, not shardlang's or torch's
    else:
        assert "shardlang: error: rank 1 died: worker exited with code -9 (killed by signal 9)" in done.stderr


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
        outputs = [node.communicate(timeout=600) for node in nodes]
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


# --- a check that raises inside model code, and --json on every way out ------------------------------

RAISES = "tests/fixtures/raises"


def one_object(stdout: str) -> dict:
    """stdout holds exactly one JSON object, and nothing else."""
    report, end = json.JSONDecoder().raw_decode(stdout.lstrip())
    assert stdout.lstrip()[end:].strip() == "", stdout
    return report


def test_check_raising_in_a_modules_forward_names_the_module_and_its_rule():
    """Heads.forward reshapes to a hard-coded width that colwise halves: the module whose forward raised,
    the rule inside it whose output it was reading, and its own line, in the text and in the JSON."""
    done = shardlang_apply(f"{RAISES}/heads.sl", f"{RAISES}/heads.py", "--nproc", "2", "--json")
    assert done.returncode == 1, done.stderr
    report = one_object(done.stdout)
    assert report["exit_status"] == 1 and report["ok"] is False
    assert report["failure"]["kind"] == "raised" and report["failure"]["rank"] in (0, 1)
    check, module = report["diagnostics"]
    assert check["code"] == module["code"] == "SL400" and check["line"] == 7
    assert "check gradients raised on rank" in check["message"] and "is invalid for input of size" in check["message"]
    assert module["message"].startswith("raised in module 'block' (Heads), in its forward: RuntimeError: shape")
    assert (module["file"], module["line"], module["col"]) == (f"{RAISES}/heads.sl", 4, 5)  # block.proj : colwise
    assert f"in {RAISES}/heads.py:17 in forward: h = h.view(" in module["help"]
    assert "a rule inside it, on block.out" in module["help"]
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["said"] == "check gradients" for r in report["ranks"]), report["ranks"]
    assert any(r["state"] == "raised" and "is invalid" in r["error"] for r in report["ranks"])
    # stderr says the same in text, without a traceback
    assert "error[SL400] raised in module 'block' (Heads)" in done.stderr
    assert "a rule inside it, on block.proj" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs pip install -e '.[hf]'")
def test_check_raising_in_transformers_code_names_the_decoder_layer_and_the_package():
    """o_proj column-wise leaves the attention's output half as wide as the residual: the add inside
    transformers' LlamaDecoderLayer.forward raises. Named: that layer, o_proj's rule, transformers' line
    and version; not 'raised inside torch or shardlang'."""
    import transformers

    done = shardlang_apply(f"{RAISES}/hf_llama_o_colwise.sl", "examples/hf_llama.py", "--nproc", "2")
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert "The size of tensor a (64) must match the size of tensor b (32) at non-singleton dimension 2" in done.stderr
    assert (
        f"{RAISES}/hf_llama_o_colwise.sl:6:5: error[SL400] raised in module 'model.layers.0' (LlamaDecoderLayer), "
        "in its forward" in done.stderr
    ), done.stderr
    assert "a rule inside it, on model.layers.0.self_attn.o_proj" in done.stderr
    assert re.search(
        rf"= help: in transformers/models/llama/modeling_llama\.py:\d+ in forward, transformers "
        rf"{re.escape(transformers.__version__)}: hidden_states = residual \+ hidden_states",
        done.stderr,
    ), done.stderr
    assert "not in your files" not in done.stderr and "Traceback" not in done.stderr


def test_json_when_a_worker_dies_by_a_signal(applied):
    done = applied(*DIES, "--json", env={"SHARDLANG_TEST_FAULT": "kill"})
    assert done.returncode == 2
    report = one_object(done.stdout)
    assert report["exit_status"] == 2 and report["ok"] is False and report["checks"] == []
    assert report["failure"]["kind"] == "died" and report["failure"]["rank"] == 1
    assert "killed by signal 9" in report["failure"]["message"]
    dead = report["ranks"][1]
    # its last word: what it had started (a message sent just before the kill may not have left its queue)
    assert dead["state"] == "died" and dead["exit_code"] == -9, dead
    assert dead["said"] in ("loading the model file", "building the model"), dead
    assert "rank 1 died" in done.stderr


def test_json_for_a_usage_error():
    """A usage error found before any worker starts: the same one object, exit 2."""
    done = shardlang_apply("plans/mlp_tp.sl", "--nproc", "2", "--json")
    assert done.returncode == 2
    report = one_object(done.stdout)
    assert report["exit_status"] == 2 and report["failure"]["kind"] == "usage"
    assert report["failure"]["message"].startswith("apply needs a model")
    assert report["ranks"] == [] and "shardlang: error: apply needs a model" in done.stderr


def test_json_under_torchrun_when_a_check_raises():
    """Under torchrun no launcher collects the ranks: rank 0 prints the object, saying what it did itself."""
    from shardlang.launch.workers import free_port

    done = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"),
            *("--master-addr", "127.0.0.1", "--master-port", str(free_port())),
            *("-m", "shardlang", "apply", f"{RAISES}/heads.sl", f"{RAISES}/heads.py", "--device", "cpu", "--json"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 1, done.stderr
    report = one_object(done.stdout)
    assert report["exit_status"] == 1 and report["failure"]["kind"] == "raised" and report["failure"]["rank"] == 0
    (rank,) = report["ranks"]
    assert rank["rank"] == 0 and rank["said"] == "check gradients" and rank["state"] == "raised", rank
    assert report["diagnostics"][1]["message"].startswith("raised in module 'block' (Heads), in its forward")


def test_frames_are_told_apart_by_package_and_version():
    """What a check that raised says of a frame that is not the user's: the package and its version, and
    the path inside the package; the user's own files (a model file under the project) are nobody's."""
    import torch
    import torch.nn.functional as F

    from shardlang.launch import job
    from shardlang.launch.frames import package_of

    assert package_of(F.__file__) == (f"torch {torch.__version__}", "torch/nn/functional.py")
    assert package_of(job.__file__)[1] == "shardlang/launch/job.py"
    assert package_of(job.__file__)[0].startswith("shardlang ")
    assert package_of(json.__file__) == (f"python {sys.version_info[0]}.{sys.version_info[1]}", "json/__init__.py")
    assert package_of(str(ROOT / RAISES / "heads.py")) is None
    if HAS_TRANSFORMERS:
        import transformers
        from transformers.models.llama import modeling_llama

        assert package_of(modeling_llama.__file__) == (
            f"transformers {transformers.__version__}",
            "transformers/models/llama/modeling_llama.py",
        )


def test_a_job_past_its_time_is_a_timeout_with_what_each_rank_said():
    """The launcher's side of --timeout, which `apply --json` reports as `failure.kind` and `ranks` (the
    path to the object is that of a worker that died, above)."""
    from shardlang.launch.workers import WorkerError, WorkerPool

    pool = WorkerPool(1, timeout_s=600)
    with pytest.raises(WorkerError) as raised:
        pool.run(time.sleep, 60, timeout_s=1)
    assert raised.value.kind == "timeout" and "timed out after 1 s: rank 0 still running" in raised.value.headline
    assert raised.value.ranks == [{"rank": 0, "said": "running its job", "state": "running"}]
    assert pool.broken


def test_a_check_that_compared_nothing_is_a_note_said_once():
    """The note read "compared nothing: nothing compared: ...", and was printed as a yellow `warning:` on a
    run that failed because of it (exit 2): it is the run's own account, printed as a note."""
    from rich.console import Console

    from shardlang.launch.job import unanswered
    from shardlang.launch.report import Report, render
    from shardlang.verification import SKIPPED, CheckResult

    skipped = CheckResult("module_states", SKIPPED, "nothing compared: no mesh dim has replicas of any tensor", 0.1)
    note = unanswered(skipped)
    assert note == "check module_states was asked for but compared nothing: no mesh dim has replicas of any tensor"
    report = Report(ok=False, world_size=2, device="cpu (gloo)", checks=(skipped,), notes=(note,), usable=False)
    console = Console(record=True, width=200)
    render(report, {}, console)
    text = console.export_text()
    assert f"note: {note}" in text and "warning:" not in text, text
    assert report.to_json()["warnings"] == [note]  # the JSON keeps notes where they were
