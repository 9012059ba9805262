"""On GPUs (skipped without at least two): apply with NCCL, `init meta` with DTensor's CUDA RNG,
checkpoints of CUDA shards resharded across plans, and explain against a real NCCL run. The device tool runs these on H100/H200 machines (RESULTS.md)."""

import json
import subprocess
import sys

import pytest
import torch

from .conftest import ROOT

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.distributed, pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")]
ALL_CHECKS = "init,gradients,module_states,init_device,placements,comms"


def apply_on_gpus(plan: str, model: str, nproc: int = 2):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardlang",
            "apply",
            plan,
            model,
            "--device",
            "cuda",
            "--nproc",
            str(nproc),
            "--verify",
            ALL_CHECKS,
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, _why(done)
    return json.loads(done.stdout)


def _why(done) -> str:
    """What failed, first: the failing checks' messages and the errors (the JSON report's tail would be
    its last check's data), then the tail of stderr."""
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        return done.stdout[-3000:] + done.stderr[-3000:]
    failed = [f"{c['check']}: {c['message']}" for c in report["checks"] if c["status"] not in ("pass", "reported")]
    errors = [d["message"] for d in report["diagnostics"] if d["severity"] == "error"]
    return "\n".join(failed + errors) + "\n" + done.stderr[-2000:]


@pytest.mark.parametrize(
    ("plan", "model"),
    [
        ("plans/mlp_tp.sl", "examples/mlp.py"),
        ("plans/llama_2d.sl", "examples/llama.py"),
        ("plans/llama_loss_parallel.sl", "examples/llama.py"),
        ("plans/llama_fsdp_offload.sl", "examples/llama.py"),
    ],
)
def test_apply_with_nccl_passes_all_six_checks(plan, model):
    report = apply_on_gpus(plan, model)
    assert report["device"] == "cuda (nccl)" and report["ok"]
    assert {c["check"] for c in report["checks"]} == set(ALL_CHECKS.split(","))
    statuses = {c["check"]: c["status"] for c in report["checks"]}
    assert all(s == "pass" or (c, s) == ("comms", "reported") for c, s in statuses.items()), statuses
    init = next(c for c in report["checks"] if c["check"] == "init_device")
    assert init["data"]["device"].startswith("cuda:")


def test_init_rank0_loads_into_offloaded_shards(tmp_path):
    """`init rank0` under `offload = cpu`: FSDP pins the unit's shards in CPU memory when they are
    allocated, and rank 0's weights are scattered into them there."""
    plan = tmp_path / "llama_fsdp_offload_rank0.sl"
    plan.write_text((ROOT / "plans" / "llama_fsdp_offload.sl").read_text().replace("\ninit meta\n", "\ninit rank0\n"))
    assert "init rank0" in plan.read_text()
    report = apply_on_gpus(str(plan), "examples/llama.py")
    statuses = {c["check"]: c["status"] for c in report["checks"]}
    assert report["ok"] and statuses["init"] == statuses["init_device"] == "pass", statuses


def shards_on_cuda_are_distinct(plan_text: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import shardlang
    from examples.seeds.uneven import build_model

    plan = shardlang.loads(plan_text)
    torch.manual_seed(0)
    model = plan.build(build_model)
    plan.apply(model)
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        assert local.device == torch.device("cuda", torch.cuda.current_device()), f"{name} on {local.device}"
        # Decided from the global shape, the same on every rank (each rank then joins the collective).
        if (
            isinstance(p, DTensor)
            and not all(pl.is_replicate() for pl in p.placements)
            and p.shape[0] % dist.get_world_size() == 0
        ):
            gathered = [torch.empty_like(local.flatten()) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local.flatten().contiguous())
            out[name] = len({tuple(t.tolist()) for t in gathered})
    return out


def test_meta_init_on_cuda_gives_every_shard_its_own_values():
    from shardlang.launch.workers import WorkerPool

    plan = "mesh world = cuda[dp=auto]\nfully_shard on world.dp { each even }\ninit meta\n"
    with WorkerPool(2, backend="nccl") as pool:
        distinct = pool.run(shards_on_cuda_are_distinct, plan)[0]
    assert distinct and all(n == 2 for n in distinct.values()), distinct


def apply_init_on_gpus(tmp_path, text: str, model: str, offload: bool = False) -> dict:
    """`verify init` of a plan on 2 GPUs: the init check's result, whatever it is."""
    plan = tmp_path / "init.sl"
    plan.write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "shardlang", "apply", str(plan), model, "--device", "cuda", "--nproc", "2", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(done.stdout)
    (check,) = report["checks"]
    return check


SHARD_INIT = (
    "mesh world = cuda[dp=auto]\nfully_shard on world.dp {{ each net1; each net2{offload} }}\ninit meta with {m}\n"
)


@pytest.mark.parametrize("offload", [False, True], ids=["on-gpu", "offload"])
def test_meta_init_method_on_cuda_shards(tmp_path, offload):
    """`init meta with METHOD` on CUDA runs the method once on the root, on the DTensors: a method that fills
    each local shard from one seed fills every shard alike (the init check says so), its per-rank twin
    passes. Under `offload = cpu` the shards are on the CPU: the method is given whole tensors, and both pass."""
    extra = "; offload = cpu" if offload else ""
    text = SHARD_INIT.format(offload=extra, m="init_weights") + "verify init\n"
    alike = apply_init_on_gpus(tmp_path, text, "tests/faults/shard_init.py")
    if offload:
        assert alike["status"] == "pass", alike["message"]
    else:
        assert alike["status"] == "fail" and "identical shards" in alike["message"], alike["message"]
    text = SHARD_INIT.format(offload=extra, m="init_weights_per_rank") + "verify init\n"
    per_rank = apply_init_on_gpus(tmp_path, text, "tests/faults/shard_init.py")
    assert per_rank["status"] == "pass", per_rank["message"]


def test_meta_init_discarding_the_models_own_init_fails_on_cuda(tmp_path):
    """tests/faults/own_init.py on GPUs: `init meta` without the model's init_weights fails, with it passes."""
    text = "mesh world = cuda[dp=auto]\nfully_shard on world.dp { each net1; each net2 }\ninit meta\nverify init\n"
    check = apply_init_on_gpus(tmp_path, text, "tests/faults/own_init.py")
    assert check["status"] == "fail" and "net1.weight: standard deviation" in check["message"], check["message"]
    fixed = text.replace("init meta", "init meta with init_weights")
    check = apply_init_on_gpus(tmp_path, fixed, "tests/faults/own_init.py")
    assert check["status"] == "pass", check["message"]


def test_checkpoint_of_cuda_shards_loads_bitwise_under_other_plans(tmp_path):
    """Saved from (dp 2 x tp 2) on GPUs when there are 4 (else tp 2), loaded under tp 2 on 2 GPUs and in
    one process on the CPU: every model and Adam tensor bit for bit (as the CPU tests check on gloo)."""
    from shardlang.checkpoints.loading import load_checkpoint
    from shardlang.launch.workers import WorkerPool

    from . import checkpoint_jobs as jobs
    from .test_checkpoints import LLAMA, LLAMA_2D, assert_bitwise

    directory = str(tmp_path / "ck")
    world = 4 if GPUS >= 4 else 2
    with WorkerPool(world, backend="nccl") as pool:
        want = pool.run(jobs.train_and_save, LLAMA_2D, {"tp": 2}, LLAMA, directory)[0]
    with WorkerPool(2, backend="nccl") as pool:
        for rank, got in enumerate(pool.run(jobs.load_under, LLAMA_2D, {"tp": 2}, LLAMA, directory)):
            assert_bitwise(got, want, f"rank {rank} of 2 GPUs")
    from examples.llama import build_model

    model = build_model()
    optimizer = torch.optim.Adam(model.parameters())
    load_checkpoint(model, directory, optimizer)
    assert_bitwise(jobs.full_state(model, optimizer), want, "one CPU process")


# --- issue 39: a mixture of experts under bf16 on GPUs --------------------------------------------------------
#
# ERNIE-4.5-MoE with attention and its shared expert tensor parallel, its routed experts split by expert
# (expert_parallel) and FSDP2 in bf16 passed on gloo CPU workers and failed on 2 x H200 at its routers
# (1.53 x the allowed error) and experts (1.17 to 1.37 x), twice alike: tokens sent to other experts than
# the reference sent them to. Its routers now stay float32 as transformers keeps them (compiler/float32.py)
# and the references replay the sharded run's routing (verification/routing.py); a router gradient
# summed over tp must still fail.
ERNIE = "examples/families/ernie4_5_moe.py"
ERNIE_PLAN = "tests/fixtures/families/ernie4_5_moe_ep_bf16.sl"
ERNIE_ROUTER_FAULT = "tests/fixtures/families/ernie4_5_moe_router_allreduced.sl"
needs_transformers = pytest.mark.skipif(
    __import__("importlib").util.find_spec("transformers") is None, reason="needs transformers: pip install -e '.[hf]'"
)


def apply_json(plan: str, model: str, checks: str = ALL_CHECKS) -> dict:
    """`apply --json` on 2 GPUs, whatever its verdict: the report (a crash fails the test, saying why)."""
    done = subprocess.run(
        [sys.executable, "-m", "shardlang", "apply", plan, model, "--device", "cuda", "--nproc", "2"]
        + ["--verify", checks, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no report (exit {done.returncode}): {done.stdout[-2000:]}{done.stderr[-3000:]}")


@needs_transformers
def test_ernie_moe_tp_ep_bf16_passes_every_check_on_gpus():
    report = apply_on_gpus(ERNIE_PLAN, ERNIE)
    statuses = {c["check"]: c["status"] for c in report["checks"]}
    assert report["device"] == "cuda (nccl)" and report["ok"], statuses
    assert all(s == "pass" or (c, s) == ("comms", "reported") for c, s in statuses.items()), statuses
    gradients = next(c for c in report["checks"] if c["check"] == "gradients")
    assert "2 modules kept in float32" in gradients["message"], gradients["message"]
    print(gradients["message"], gradients["data"].get("routing"))  # the replayed tokens, for the record (-s)


@needs_transformers
def test_ernie_moe_router_gradient_summed_over_tp_fails_on_gpus():
    report = apply_json(ERNIE_ROUTER_FAULT, ERNIE, "gradients")
    (check,) = report["checks"]
    assert check["status"] == "fail", check["message"]
    assert "(grad model.layers." in check["message"] and ".mlp.gate.weight)" in check["message"], check["message"]
