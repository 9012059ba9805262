"""Verdicts on model code shardlang has never seen (issue 23): models whose state-dict hooks rename their
tensors (torchtitan's fused QKV), models that initialise themselves with their own function, recursive
initialisers under `init meta with METHOD`, and tied weights under `init rank0`. Runs `shardlang apply`'s
job on the test worker pools."""

import pytest

import shardlang
from shardlang.launch.job import Job, run

from .conftest import ROOT


def apply(pools, tmp_path, world: int, text: str, model: str, **job):
    path = tmp_path / "plan.sl"
    path.write_text(text)
    model = model if model.startswith("/") else str(ROOT / model)
    checks = shardlang.load(path).checks
    return pools(world).run(run, Job(str(path), {}, model, None, checks, explicit=True, **job))[0]


def statuses(report) -> dict:
    return {c.check: (c.status, c.message) for c in report.checks}


def assert_all_pass(report):
    assert report.ok and all(c.status == "pass" for c in report.checks), statuses(report)


# --- tied weights under init rank0 ------------------------------------------------------------------

TIED_RANK0 = {
    # rank 0 moved its model to meta with `model.to`, which unties an embedding shared with the output
    # layer: FSDP then sharded three parameters on rank 0 and two elsewhere, and gloo aborted the worker
    "fsdp": (2, "mesh world = cpu[dp=auto]\nfully_shard on world.dp { }\n"),
    "hsdp": (4, "mesh world = cpu[rep=2, shard=2]\nfully_shard on world[rep, shard] { }\n"),
    "tp-fsdp": (
        4,
        "mesh world = cpu[dp=2, tp=2]\nparallelize on world.tp { embedding : colwise; fc : rowwise }\n"
        "fully_shard on world.dp { }\n",
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(TIED_RANK0))
def test_tied_weights_under_init_rank0(pools, tmp_path, case):
    world, plan = TIED_RANK0[case]
    text = plan + "init rank0\nverify init, init_device, placements, gradients(steps=1)\n"
    assert_all_pass(apply(pools, tmp_path, world, text, "examples/tied.py"))


# --- state-dict hooks that rename tensors -------------------------------------------------------------

FUSED = "tests/fused_qkv.py"
TITAN = "examples/field/titan_llama3.py"
FUSED_2D = """mesh world = cpu[dp=2, tp=2]
parallelize layers.* on world.tp { attention.wqkv : colwise; out : rowwise }
fully_shard on world.dp { each layers.* }
"""
TITAN_2D = """mesh world = cpu[dp=2, tp=2]
parallelize layers.* on world.tp {
    attention.qkv_linear.wqkv : colwise
    attention.wo              : rowwise
    feed_forward.{w1,w3}      : colwise
    feed_forward.w2           : rowwise
}
fully_shard on world.dp { each layers.* }
"""
FSDP = "mesh world = cpu[dp=auto]\nfully_shard on world.dp { each layers.* }\n"
HOOKED = {
    "own": (FUSED, FUSED_2D, "layers.0.attention"),
    "torchtitan": (TITAN, TITAN_2D, "layers.0.attention.qkv_linear"),
}


def _titan_or_skip(model: str) -> None:
    if model == TITAN:
        pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install -e '.[titan]'")


@pytest.mark.distributed
@pytest.mark.parametrize("which", sorted(HOOKED))
def test_every_check_runs_on_a_model_whose_state_dict_hooks_rename_tensors(pools, tmp_path, which):
    """The references are built by parameter name: a state dict keyed `wq`/`wk`/`wv` for a module holding
    `wqkv` made the gradients check raise AttributeError."""
    model, plan, _ = HOOKED[which]
    _titan_or_skip(model)
    text = plan + "init cpu\nverify init, placements, module_states, gradients(steps=1)\n"
    assert_all_pass(apply(pools, tmp_path, 4, text, model))


def save_under(plan_text: str, model: str, directory: str, form: str) -> dict:
    """Apply the plan to a model built with seed 0, save it as a DCP checkpoint or Hugging Face weights;
    every parameter and buffer, whole, by name."""
    from shardlang.checkpoints.hf import save_hf_weights
    from shardlang.checkpoints.saving import save_checkpoint

    module = _applied(plan_text, model, seed=0)
    (save_checkpoint if form == "dcp" else save_hf_weights)(module, directory)
    return _named_whole(module)


def load_under(plan_text: str, model: str, directory: str, form: str) -> dict:
    """Apply the plan to a model built with another seed on every rank, load `directory`; as save_under."""
    import torch.distributed as dist

    from shardlang.checkpoints.hf import load_hf_weights
    from shardlang.checkpoints.loading import load_checkpoint

    module = _applied(plan_text, model, seed=1 + dist.get_rank())
    (load_checkpoint if form == "dcp" else load_hf_weights)(module, directory)
    return _named_whole(module)


def _applied(plan_text: str, model: str, seed: int):
    import torch

    from shardlang.runtime.apply import apply_plan

    from .dist_jobs import load

    plan = shardlang.loads(plan_text)
    torch.manual_seed(seed)
    module = plan.build(load(model))
    apply_plan(plan, module)
    return module


def _named_whole(module) -> dict:
    from shardlang.verification.reference import full

    return {n: full(t.detach()).cpu().clone() for n, t in [*module.named_parameters(), *module.named_buffers()]}


@pytest.mark.distributed
@pytest.mark.parametrize("form", ["dcp", "hf"])
@pytest.mark.parametrize("which", sorted(HOOKED))
def test_a_checkpoint_holds_the_hooked_names_and_loads_back_under_another_plan(pools, tmp_path, which, form):
    """Saved and loaded through the model's own state-dict hooks, as torchtitan's checkpointer does: the
    checkpoint (DCP, or Hugging Face safetensors) holds `wq`/`wk`/`wv`, and a model sharded another way on
    another world loads it bitwise."""
    import torch

    from shardlang.checkpoints.hf import read_hf_weights
    from shardlang.checkpoints.reading import read_checkpoint

    model, plan, fused = HOOKED[which]
    _titan_or_skip(model)
    if form == "hf":
        pytest.importorskip("safetensors")
    spec = model.removesuffix(".py").replace("/", ".") + ":build_model"
    directory = str(tmp_path / "ck")
    saved = pools(4).run(save_under, plan, spec, directory, form)[0]
    keys = set(read_checkpoint(directory).model if form == "dcp" else read_hf_weights(directory).tensors)
    assert {f"{fused}.wq.weight", f"{fused}.wk.weight", f"{fused}.wv.weight"} <= keys
    assert f"{fused}.wqkv.weight" not in keys
    for rank, loaded in enumerate(pools(2).run(load_under, FSDP, spec, directory, form)):
        assert loaded.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), f"rank {rank}: {name} differs from what was saved"


# --- init meta: the model's own initialisation, recursive initialisers ---------------------------------

TITAN_META = {
    # torchtitan's build_model initialises with init_states (trunc_normal std 0.02, depth-scaled): init meta
    # without it gave kaiming-uniform weights 3-5x as wide, and the init check passed them
    "init meta": ("fail", ["layers.0.attention.qkv_linear.wqkv.weight: standard deviation", "with init_states"]),
    # init_states on the root recurses into every child: called on every module, children already sharded,
    # it filled every shard on a CPU mesh with the same values
    "init meta with init_states": ("pass", []),
}


@pytest.mark.distributed
@pytest.mark.parametrize("init", sorted(TITAN_META))
def test_torchtitan_init_states_under_init_meta(pools, tmp_path, init):
    _titan_or_skip(TITAN)
    status, words = TITAN_META[init]
    report = apply(pools, tmp_path, 4, TITAN_2D + f"{init}\nverify init\n", TITAN)
    (result,) = report.checks
    assert result.status == status, result.message
    for word in words:
        assert word in result.message, f"{word!r} not in {result.message!r}"


@pytest.mark.distributed
def test_a_method_on_the_root_is_called_once_with_whole_tensors_on_a_cpu_mesh(pools, tmp_path):
    """tests/faults/shard_init.py's init_weights fills whatever tensors it is given from one seed: called once
    on the root with every sharded tensor whole, each rank keeps its own slice and replicas agree."""
    text = (
        "mesh world = cpu[dp=2, tp=2]\nparallelize on world.tp { net1 : colwise; net2 : rowwise }\n"
        "fully_shard on world.dp { each net1; each net2 }\ninit meta with init_weights\n"
        "verify init, module_states, gradients(steps=1)\n"
    )
    assert_all_pass(apply(pools, tmp_path, 4, text, "tests/faults/shard_init.py"))


def test_initialisation_calls_call_a_method_once_on_each_outermost_module():
    import torch.nn as nn

    from shardlang.compiler.initialisers import initialisation_calls

    class Leaf(nn.Linear):
        def init_weights(self):
            pass

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Leaf(2, 2), Leaf(2, 2)

        def init_weights(self):
            pass

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.alone, self.plain = Inner(), Leaf(2, 2), nn.Linear(2, 2)
            self.shared = self.inner.a  # also under `inner`, which covers it

    root = Root()
    calls = initialisation_calls(root, "init_weights")
    assert [(m, subtree) for m, _, subtree in calls] == [(root.inner, True), (root.alone, True)]
    own = initialisation_calls(root)
    assert [m for m, _, _ in own] == [root.inner.a, root.inner.b, root.alone, root.plain]
    assert not any(subtree for _, _, subtree in own)
