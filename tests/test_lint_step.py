"""lint's simulated training step agrees with apply (issue 39): every example plan lints clean with the step,
at the world its apply test runs it at; under context parallelism a cp rank's shard of the sequence, which a
data-parallel block over cp sums, is no SL222; what fake tensors cannot run (transformers' experts loop over
the experts hit, `nonzero`; a model's own `.item()`; torch._grouped_mm in float32) the step runs through
instead of reporting it as the plan's fault. Beside each, a planted mistake the step must still find, named
at the right module's rule. The step runs in a forked child holding a fake process group: the distributed lane
(the stand-ins themselves are tested in the fast lane, on a fake tensor mode alone).
"""

from __future__ import annotations

import copy
import importlib.util
import re

import pytest
import torch

from shardlang.cli import main

from .conftest import FIXTURES, ROOT
from .test_apply_cli import EXAMPLE_PLANS, example_id, model_of, world_of

SEEDS = sorted((ROOT / "plans" / "seeds").glob("*.sl"))
STEP = FIXTURES / "lint_step"
FAMILIES = ("gpt_oss", "qwen2_moe", "ernie4_5_moe", "jamba")
#: More mixtures of experts whose experts run their own forward, linted under FSDP alone (issue 39 names them).
MORE_EXPERTS = ("phimoe", "granitemoe", "deepseek_v3")
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs pip install -e '.[hf]'"
)

#: A family's model with transformers' eager experts: a loop over the experts hit, found by `nonzero`.
EAGER = """from examples.families.{family} import build_model as _build
from examples.families.{family} import example_input, loss  # noqa: F401


def build_model():
    model = _build()
    model.config._experts_implementation = "eager"
    return model
"""


def lint(capsys, monkeypatch, plan, model, world: int) -> tuple[int, str]:
    """`shardlang lint PLAN MODEL --world N` with the step, as a user runs it: its status and what it printed."""
    monkeypatch.chdir(ROOT)
    status = main(["lint", str(plan), str(model), "--world", str(world)])
    out = capsys.readouterr()
    return status, out.out + out.err


def assert_clean_and_stepped(status: int, text: str) -> None:
    """No error, and the step ran through its backward (a step that could not run finds nothing)."""
    assert status == 0 and "error[" not in text, text
    assert "training step simulated" in text and "could not be simulated" not in text, text
    assert "the step stopped" not in text, text


def errors(text: str) -> list[tuple[str, int, str]]:
    """(code, line, module) of each error, the module as its message names it first (SL221: the module whose
    output the loss is handed)."""
    found = re.findall(r":(\d+):\d+: error\[(SL\d+)\] [^\n]*?(?:module|the output of) '([^']+)'", text)
    return [(code, int(line), module) for line, code, module in found]


def line_of(plan_text: str, needle: str) -> int:
    return next(i for i, line in enumerate(plan_text.splitlines(), 1) if needle in line)


# --- every example plan ---------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("plan", EXAMPLE_PLANS, ids=example_id)
def test_every_example_plan_lints_clean_with_the_step(capsys, monkeypatch, plan):
    """What tests/test_apply_cli.py applies (and every check passes), lint with its step passes, at that world."""
    assert_clean_and_stepped(*lint(capsys, monkeypatch, plan, model_of(plan), world_of(plan)))


#: Plans whose model's own forward raises on its example input, unsharded too (their checks run no forward):
#: the step stops there with a note and no finding. Strict: such a plan must say so.
UNSTEPPABLE = {
    "tp_fsdp_sync_module_state": "examples/seeds/per_rank.py adds an (8, 8) buffer to a (batch, 8) product",
}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("plan", SEEDS, ids=lambda p: p.stem)
def test_every_seed_plan_lints_clean_with_the_step(capsys, monkeypatch, plan, world):
    """The seed scenarios (tests/test_seeds.py applies them at world 2 or 4; both are linted)."""
    status, text = lint(capsys, monkeypatch, plan, model_of(plan), world)
    if plan.stem not in UNSTEPPABLE:
        assert_clean_and_stepped(status, text)
        return
    assert status == 0 and "error[" not in text, text
    assert "the step stopped" in text and "the unsharded model raises too" in text, text


# --- context parallelism: a cp rank's shard, summed over cp, is no SL222 -----------------------------------


@pytest.mark.distributed
def test_a_cp_shard_summed_over_cp_is_no_partial_gradient(capsys, monkeypatch):
    """plans/llama_cp.sl: every module gets a cp rank's shard of the sequence; fully_shard over dp*cp sums them."""
    assert_clean_and_stepped(*lint(capsys, monkeypatch, "plans/llama_cp.sl", "examples/llama.py", 4))


@pytest.mark.distributed
def test_a_cp_shard_that_no_block_over_cp_sums_is_still_sl222(capsys, monkeypatch):
    """Planted: the root's unit (tok_embeddings, norm, output) over dp alone; the layers, over dp*cp, are no finding."""
    plan = FIXTURES / "lint" / "sl222_cp_root_over_dp_alone.sl"
    status, text = lint(capsys, monkeypatch, plan, "examples/llama.py", 4)
    line = line_of(plan.read_text(), "fully_shard on world.dp")
    assert status == 1
    assert errors(text) == [("SL222", line, "tok_embeddings"), ("SL222", line, "norm"), ("SL222", line, "output")]


@pytest.mark.distributed
def test_where_fake_tensors_leave_one_rank_units_uncast_the_step_says_it_did_not_check_products(capsys, monkeypatch):
    """torch 2.11's fake tensors leave the parameters of a fully_shard unit over one rank, or beside tensor
    parallelism, uncast under mixed_precision (its real ones cast): plans/llama_2d.sl at world 2 (dp of size
    1 beside TP) and at world 4 (dp 2 x tp 2) was SL220 there, and apply passes. Where this torch does so,
    the step does not check products' dtypes in such units and says so; a 1-D unit's are checked."""
    from shardlang.runtime import torchcompat

    monkeypatch.setattr(torchcompat, "fake_fsdp_casts_one_rank_units", lambda: False)
    for world in (2, 4):
        status, text = lint(capsys, monkeypatch, "plans/llama_2d.sl", "examples/llama.py", world)
        text = " ".join(text.split())
        assert status == 0 and "the dtypes of products in fully_shard units with mixed_precision over" in text, text
        assert "plans/llama_2d.sl:27" in text
    status, text = lint(capsys, monkeypatch, "plans/llama_fsdp_offload.sl", "examples/llama.py", 4)
    assert status == 0 and "not checked" not in text, text


# --- what fake tensors cannot run ------------------------------------------------------------------------


@pytest.mark.distributed
@needs_transformers
@pytest.mark.parametrize("family", FAMILIES + MORE_EXPERTS)
@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_experts_running_their_own_forward_lint_clean(capsys, monkeypatch, tmp_path, family, experts):
    """FSDP alone in float32: transformers' default experts (torch._grouped_mm, which the meta kernel takes
    only in bf16) and its eager loop (`nonzero`) run through, said in the note, not reported."""
    model = ROOT / "examples" / "families" / f"{family}.py"
    if experts == "eager":
        model = tmp_path / f"{family}_eager.py"
        model.write_text(EAGER.format(family=family))
    status, text = lint(capsys, monkeypatch, STEP / "fsdp.sl", model, 2)
    assert_clean_and_stepped(status, text)
    assert ("nonzero" if experts == "eager" else "torch._grouped_mm ran in float32") in text, text


@pytest.mark.distributed
@needs_transformers
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_experts_lint_clean_and_a_planted_output_layer_is_still_found(
    capsys, monkeypatch, tmp_path, family
):
    """The family's starter TP plan in float32 with eager experts lints clean; with lm_head colwise (its output
    left sharded) the step runs through every experts loop and still finds SL221 at lm_head's rule."""
    model = tmp_path / f"{family}_eager.py"
    model.write_text(EAGER.format(family=family))
    plan = STEP / f"{family}_tp.sl"
    assert_clean_and_stepped(*lint(capsys, monkeypatch, plan, model, 2))
    planted = tmp_path / f"{family}_tp_lm_head_sharded.sl"
    planted.write_text(plan.read_text().replace("colwise_gather_output", "colwise"))
    status, text = lint(capsys, monkeypatch, planted, model, 2)
    assert status == 1
    assert errors(text) == [("SL221", line_of(plan.read_text(), "    lm_head "), "lm_head")], text


@pytest.mark.distributed
def test_a_models_own_item_is_run_through_and_a_planted_mistake_before_it_is_still_found(capsys, monkeypatch, tmp_path):
    """A user's `.item()` under prepare_input(input=replicate, desired=replicate): lint runs through it (said in
    its note), as apply does; `down` colwise after colwise `up` is still SL220 at down's rule."""
    plan, model = STEP / "clipped.sl", STEP / "clipped.py"
    status, text = lint(capsys, monkeypatch, plan, model, 2)
    assert_clean_and_stepped(status, text)
    assert "_local_scalar_dense in clip" in text, text
    planted = tmp_path / "clipped_two_colwise.sl"
    planted.write_text(plan.read_text().replace("down : rowwise", "down : colwise"))
    status, text = lint(capsys, monkeypatch, planted, model, 2)
    assert status == 1
    assert errors(text) == [("SL220", line_of(plan.read_text(), "down :"), "down")], text


# --- the stand-ins, on a fake tensor mode alone (no process group: the fast lane) ------------------------------


def fake_mode(stand_ins=None):
    from shardlang.explain.fakestep import recording_fake_mode
    from shardlang.verification.comms import Calls

    return recording_fake_mode(Calls(), stand_ins)


def test_the_experts_loop_runs_on_nonzeros_indices_without_a_guess():
    """transformers' loop: the experts hit (`nonzero`, every mask true), each one's index read back (`==`,
    `.item()` through the indices kept), its tokens (`torch.where`): sound stand-ins, no value guessed."""
    from shardlang.explain.fakestep import StandIns

    stand_ins = StandIns()
    with fake_mode(stand_ins):
        routed = torch.zeros(4, 2, 6) > 0  # (experts, top_k, tokens)
        ran = []
        for index in (routed.sum(dim=(-1, -2)) > 0).nonzero():
            index = index[0]
            if index == 4:  # transformers' sentinel for experts held elsewhere
                continue
            top_k, tokens = torch.where(routed[index])
            ran.append((int(index), tuple(tokens.shape)))
    assert ran == [(0, (12,)), (1, (12,)), (2, (12,)), (3, (12,))]
    assert stand_ins.seen and all(s.sound for s in stand_ins.seen) and not stand_ins.guessed


def test_a_value_fake_tensors_do_not_hold_is_a_guess_and_float32_grouped_mm_runs():
    from shardlang.explain.fakestep import StandIns

    stand_ins = StandIns()
    with fake_mode(stand_ins):
        assert torch.rand(3).amax().item() == 1.0
        a, b = torch.rand(6, 64, requires_grad=True), torch.rand(2, 64, 32, requires_grad=True)
        out = torch._grouped_mm(a, b, offs=torch.tensor([2, 6], dtype=torch.int32))
        out.sum().backward()
    assert out.shape == (6, 32) and out.dtype == a.grad.dtype == b.grad.dtype == torch.float32
    assert stand_ins.guessed and [s.op for s in stand_ins.seen] == ["aten::_local_scalar_dense"]
    assert len(stand_ins.float32_grouped_mm) == 3  # the forward's and the backward's two


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")  # the old copy's, asserted below
def test_a_copy_of_a_fake_model_shares_its_fake_mode_and_copies_no_storage_reference(monkeypatch):
    """copy_model shares the model's fake mode with the copy: a deep copy of the mode copies the storage weak
    references its converter keeps for constants (torch's StorageWeakRef, whose copies free one reference
    twice). That double free corrupted the heap of lint's step on mixtral_ep in some runs (a SIGABRT in CI)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from shardlang.explain.fakestep import StandIns, copy_model

    with fake_mode(StandIns()) as mode:
        model = torch.nn.Linear(4, 4)
        (torch.rand(3) > 0).nonzero()  # a stand-in's output: the converter keeps a weak reference to its storage
    assert mode.fake_tensor_converter.constant_storage_mapping

    def refuse(*_):
        raise AssertionError("a StorageWeakRef was copied")

    monkeypatch.setattr(StorageWeakRef, "__deepcopy__", refuse, raising=False)
    copied = copy_model(model)
    assert copied.weight.fake_mode is model.weight.fake_mode is mode
    assert copied.weight is not model.weight and copied.weight.shape == (4, 4)
    with pytest.raises(AssertionError, match="StorageWeakRef was copied"):
        copy.deepcopy(model)  # what the step did before


def test_without_stand_ins_the_fake_mode_still_refuses():
    """explain's fake mode (no stand-ins) is unchanged: what it cannot run raises, as before."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    with fake_mode(), pytest.raises(DynamicOutputShapeException):
        (torch.rand(3) > 0).nonzero()


@pytest.mark.distributed
@needs_transformers
@pytest.mark.parametrize("family", FAMILIES)
def test_what_lint_passes_with_eager_experts_apply_passes_too(pools, tmp_path, family):
    """Lint agrees with apply: the starter TP plan that lints clean with eager experts passes its checks at
    world 2 (tp 2)."""
    import shardlang
    from shardlang.launch.job import Job, run

    model = tmp_path / f"{family}_eager.py"
    model.write_text(EAGER.format(family=family))
    plan = STEP / f"{family}_tp.sl"
    report = pools(2).run(run, Job(str(plan), {}, str(model), None, shardlang.load(plan).checks))[0]
    assert report.ok, [(c.check, c.status, c.message) for c in report.checks]
    assert {c.check: c.status for c in report.checks} == {"gradients": "pass"}


#: Llama's feed-forward with its pair of Linears the wrong way round (issue 40 item 6: torch's "a and b must
#: have same reduction dim" came with no hint).
SWAPPED = """shardlang 1
mesh world = cpu[dp=auto, tp=2]
parallelize layers.* on world.tp {
    feed_forward.{w1,w3} : rowwise
    feed_forward.w2      : colwise
}
fully_shard on world.dp { each layers.* }
"""


@pytest.mark.distributed
def test_rowwise_and_colwise_swapped_are_named_as_such(capsys, monkeypatch, tmp_path):
    path = tmp_path / "swapped.sl"
    path.write_text(SWAPPED)
    status, text = lint(capsys, monkeypatch, path, "examples/llama.py", 4)
    assert status == 1 and errors(text) == [("SL220", 4, "layers.0.feed_forward.w1")], text
    assert "are `colwise` and `rowwise` swapped?" in text, text
    # the right way round: no such hint (the step runs through)
    path.write_text(SWAPPED.replace(": rowwise", ": ROW").replace(": colwise", ": rowwise").replace("ROW", "colwise"))
    assert_clean_and_stepped(*lint(capsys, monkeypatch, path, "examples/llama.py", 4))


@pytest.mark.distributed
def test_lint_after_an_explain_in_the_same_process_finds_what_it_finds_alone(capsys, monkeypatch):
    """DTensor caches how ops shard by the meshes' values and hands back the cached meshes: after an explain
    in this process, lint's step resolved the explain's (destroyed) process groups and raised SL220 in the
    first module ("Could not resolve the process group registered under the name 3"), where alone it finds
    the fixture's SL222. A simulated world starts with those caches cleared."""
    fixture = "tests/fixtures/lint/sl222_cp_norm_on_sequence_shards.sl"
    monkeypatch.chdir(ROOT)
    assert main(["explain", "plans/llama_2d.sl", "examples/llama.py", "--world", "4"]) == 0
    capsys.readouterr()
    status, text = lint(capsys, monkeypatch, fixture, "examples/llama.py", 4)
    assert status == 1 and [(code, line) for code, line, _ in errors(text)] == [("SL222", 35)], text


@pytest.mark.distributed
def test_a_forked_step_killed_by_a_signal_is_forked_once_more():
    """A fork's child that dies of a signal before its result (a segmentation fault, seen once in a full
    run) is forked once more; one that dies again is said so, by its signal."""
    import os
    import signal

    from shardlang.runtime.simulated import in_fork

    parent = os.getpid()
    marker = f"/tmp/shardlang-fork-{parent}"

    def first_dies():
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGSEGV)
        return "second"

    try:
        assert in_fork(first_dies, 30) == ("ok", "second")
    finally:
        os.remove(marker)
    assert in_fork(lambda: os.kill(os.getpid(), signal.SIGSEGV), 30) == (
        "failed",
        "the simulated run died of SIGSEGV without a result",
    )
