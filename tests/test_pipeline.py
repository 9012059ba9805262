"""Pipelines: the statement and its lint (SL211-SL216), every schedule at pp 2 x dp 2 and pp 2 x tp 2 passing
every check on gloo, the printed program training as apply does, and planted faults the gradients check
must catch: a stage fed the wrong microbatch, a split that drops a block, a loss not scaled by the
microbatch count."""

from __future__ import annotations

import pytest
import torch

import shardlang
from shardlang.compiler.lint import lint
from shardlang.frontend.read import read_file
from shardlang.launch.job import Job, run
from shardlang.launch.workers import WorkerError

from .conftest import ROOT

MODEL = str(ROOT / "examples" / "llama_pipeline.py")
SCHEDULES = {
    "gpipe": {"schedule": "gpipe"},
    "1f1b": {"schedule": "1f1b"},
    "interleaved": {"schedule": "interleaved_1f1b", "per_rank": 2},
}


def _lint(tmp_path, text: str, world: int = 4, layers: int = 4):
    from examples.llama import Transformer

    path = tmp_path / "p.sl"
    path.write_text(text)
    plan, found, _ = read_file(str(path), {}, world)
    if plan is None:
        return [(d.code, d.message) for d in found], None
    with torch.device("meta"):
        model = Transformer(layers=layers)
    linted = lint(plan, model, world)
    return [(d.code, d.message) for d in linted.diagnostics], linted


HEAD = "mesh world = cpu[pp=2, dp=auto]\n"


@pytest.mark.parametrize(
    "body, code, words",
    [
        ("pipeline on world.pp { split before norm }", "SL211", "not in a ModuleList"),
        ("pipeline on world.pp { split before layers.2, layers.1 }", "SL211", "not after the one before"),
        ("pipeline on world.pp { split before layers.0 }", "SL212", "stage 0 would hold no block"),
        ("pipeline on world.pp { split layers.* into 8 }", "SL212", "4 stage(s) would hold no block"),
        ("pipeline on world.pp { split layers.* into 4 }", "SL213", "makes 4 stages, but pp=2 runs 2"),
        ("pipeline on world.pp { split layers.{0,1} into 2 }", "SL211", "leaves out blocks"),
        ("pipeline on world.pp { split layers.* into auto; schedule = 1f1b; stages_per_rank = 2 }", "SL215", "1 stage"),
        (
            "pipeline on world.pp { split layers.* into auto; schedule = interleaved_1f1b; stages_per_rank = 1 }",
            "SL215",
            "2 or more",
        ),
        ("pipeline on world { split layers.* into auto }", "SL216", "1-D mesh"),
        (
            "pipeline on world.pp { split layers.* into auto }\nfully_shard on world[pp, dp] { }",
            "SL216",
            "pipeline dim",
        ),
        ("pipeline on world.pp { split layers.* into auto }\nloss_parallel", "SL216", "loss_parallel"),
        ("pipeline on world.pp { schedule = gpipe }", "SL102", "where to split"),
        ("pipeline on world.pp { split layers.* into auto }\ninit rank0", "SL216", "init rank0"),
        (
            "pipeline on world.pp { split layers.* into auto; microbatches = 8 }\nverify gradients(batch=4)",
            "SL215",
            "8 microbatches",
        ),
    ],
)
def test_pipeline_lint(tmp_path, body, code, words):
    found, _ = _lint(tmp_path, HEAD + body + "\n")
    assert any(c == code and words in m for c, m in found), found


def test_tied_weights_across_stages_are_refused(tmp_path):
    from examples.llama import Transformer

    path = tmp_path / "p.sl"
    path.write_text(HEAD + "pipeline on world.pp { split layers.* into auto }\n")
    plan, _, _ = read_file(str(path), {}, 4)
    with torch.device("meta"):
        model = Transformer(layers=4)
    model.output.weight = model.tok_embeddings.weight
    codes = [(d.code, d.message) for d in lint(plan, model, 4).diagnostics]
    assert any(c == "SL214" and "output.weight (stage 1)" in m for c, m in codes), codes


def test_split_resolves_blocks_and_outside_modules(tmp_path):
    text = HEAD + "pipeline on world.pp { split before layers.3 }\nfully_shard on world.dp { each layers.* }\n"
    found, linted = _lint(tmp_path, text)
    assert found == []
    stages = linted.resolution.stages
    assert stages.blocks == (("layers.0", "layers.1", "layers.2"), ("layers.3",))
    assert (stages.first, stages.last) == (("tok_embeddings",), ("norm", "output"))
    assert stages.stage_of("layers.3.attention.wq") == 1 and stages.stage_of("tok_embeddings") == 0
    assert stages.stage_of("") is None  # the root (and its parameterless buffers) is on every stage
    spec = shardlang.load(ROOT / "plans" / "llama_pipeline.sl", {"schedule": "zbv", "per_rank": 2}).pipeline
    assert spec.stage_ranks(2) == (0, 1, 1, 0)  # V schedules fold the stages back


@pytest.mark.distributed
def test_checks_that_step_other_batches_each_get_stages_of_their_shapes(pools, tmp_path):
    """torch's pipeline stages keep the microbatch shapes of their first step. The comms check steps two
    microbatches' worth, the gradients check its own batch: in that order the last stage's loss met logits
    of the comms check's shape ("Expected input batch_size (16) to match target batch_size (8)"), on
    torchtitan's Llama as on examples/llama.py. A step on other shapes now gets new stages."""
    path = tmp_path / "pp.sl"
    text = (ROOT / "plans" / "llama_pipeline.sl").read_text()
    path.write_text(text[: text.index("verify ")] + "verify comms, gradients(steps=1)\n")
    job = Job(str(path), {}, MODEL, None, shardlang.load(path).checks)
    report = pools(4).run(run, job)[0]
    assert report.ok and {c.check: c.status for c in report.checks}["gradients"] == "pass", [
        (c.check, c.message) for c in report.checks
    ] + [d.message for d in report.diagnostics]


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("plan", ["llama_pipeline", "llama_pipeline_tp"])
def test_every_schedule_passes_every_check(pools, plan, schedule):
    """pp 2 x dp 2 (FSDP in each stage) and pp 2 x tp 2, for GPipe, 1F1B and interleaved 1F1B."""
    path = ROOT / "plans" / f"{plan}.sl"
    params = SCHEDULES[schedule]
    job = Job(str(path), params, MODEL, None, shardlang.load(path, params).checks)
    report = pools(4).run(run, job)[0]
    assert report.ok, [(c.check, c.message) for c in report.checks] + [d.message for d in report.diagnostics]
    statuses = {c.check: c.status for c in report.checks}
    assert statuses == {
        "init": "pass",
        "gradients": "pass",
        "module_states": "pass",
        "init_device": "pass",
        "placements": "pass",
        "comms": "reported",
    }
    comms = next(c for c in report.checks if c.check == "comms").data["counts"]
    # Rank 0 holds stage 0 (and stage 2, interleaved): per microbatch, one activation or gradient each way
    # across each boundary of its stages with another rank's (0|1, and interleaved also 1|2 and 2|3).
    boundaries = 1 if schedule != "interleaved" else 3
    assert comms["send"] == comms["recv"] == 4 * boundaries, comms


def _emitted_job(source: str, plan_path: str):
    """The printed program and `shardlang apply`'s runtime train the same model on the same batch."""
    import torch.distributed as dist

    from examples.llama_pipeline import build_model, example_input, loss
    from shardlang.runtime.apply import apply_plan, build_pipeline

    namespace: dict = {}
    exec(compile(source, "emitted.py", "exec", dont_inherit=True), namespace)  # noqa: S102 - the program compile printed
    tokens = example_input(8, torch.Generator().manual_seed(3))
    results = []
    for kind in ("emitted", "apply"):
        torch.manual_seed(0)
        model = build_model()
        if kind == "emitted":
            pipeline = namespace["apply_plan"](model, loss)
        else:
            applied = apply_plan(shardlang.load(plan_path), model)
            pipeline = build_pipeline(applied, loss)
        value = pipeline.step(tokens)
        grads = {
            n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for part in pipeline.parts.values()
            for n, p in part.named_parameters()
        }
        results.append((None if value is None else float(value), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == loss_b
    assert grads_a.keys() == grads_b.keys() and grads_a
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    dist.barrier()
    return loss_a


@pytest.mark.distributed
def test_printed_program_trains_as_apply_does(pools):
    from examples.llama_pipeline import build_model
    from shardlang.emit.python import compile_python

    path = str(ROOT / "plans" / "llama_pipeline_tp.sl")
    with torch.device("meta"):
        model = build_model()
    source = compile_python(shardlang.load(path), model, 4)
    assert "for stage, model in stages.items():" in source and "def apply_plan(model, loss):" in source
    losses = pools(4).run(_emitted_job, source, path)
    assert [x is not None for x in losses] == [False, False, True, True]  # the last stage's ranks


# --- planted faults -------------------------------------------------------------------------------


def _faulty(fault: str, job: Job):
    """Run `job` with a fault planted in the pipeline runtime (on every rank: the same ops everywhere)."""
    from shardlang.compiler import stages as compiler_stages
    from shardlang.runtime import apply as runtime_apply
    from shardlang.runtime import pipeline as runtime_pipeline

    if fault == "microbatch order":
        real = runtime_pipeline.stage_inputs

        def shuffled(carry, receives):
            hook = real(carry, receives)
            seen = []

            def wrong(module, args, kwargs):
                # The stage is fed the activation of the microbatch before (the first its own). The received
                # one stays in the graph, at zero weight: torch 2.11 refuses a stage that sends no gradient.
                seen.append(args[0].detach().clone())  # its own copy: the receive buffer is reused
                if receives and len(seen) > 1:
                    args = (seen[-2] + 0 * args[0], *args[1:])
                return hook(module, args, kwargs)

            return wrong

        runtime_pipeline.stage_inputs = shuffled
    elif fault == "dropped block":
        real = compiler_stages.Stages.dropped

        def dropping(self, stage):
            # The split forgets layers.1: no stage runs it.
            extra = (("layers.1", "block"),) if stage == 0 else ()
            return real(self, stage) + extra

        compiler_stages.Stages.dropped = dropping
    elif fault == "unscaled loss":
        real = runtime_apply.build_pipeline
        runtime_apply.build_pipeline = lambda applied, loss, scale_grads=True: real(applied, loss, False)
    try:
        return run(job)
    finally:
        if fault == "microbatch order":
            runtime_pipeline.stage_inputs = real
        elif fault == "dropped block":
            compiler_stages.Stages.dropped = real
        else:
            runtime_apply.build_pipeline = real


@pytest.mark.distributed
@pytest.mark.parametrize(
    "fault, words",
    [
        # Every stage's gradients are wrong; the report tells of the rank with the worst error, whichever stage it holds.
        ("microbatch order", ["step 0: gradient of", "x the allowed error"]),
        ("dropped block", ["layers.1.attention.wq.weight is held by no pipeline stage"]),
        ("unscaled loss", ["step 0: gradient of"]),
    ],
)
def test_planted_pipeline_faults_fail_the_gradients_check(pools, fault, words):
    path = ROOT / "plans" / "llama_pipeline.sl"
    checks = tuple(c for c in shardlang.load(path).checks if c.name == "gradients")
    job = Job(str(path), {}, MODEL, None, checks)
    report = pools(4).run(_faulty, fault, job)[0]
    (gradients,) = report.checks
    assert gradients.status == "fail", gradients.message
    said = gradients.message + "; ".join(gradients.data["failures"])
    if fault == "microbatch order" and "not finite" in said:
        # In some runs (2 of 3 at 4f90fe0, before this change too) the first stage's gradients come out
        # non-finite under this fault instead of merely wrong; not yet understood. Still a failed check.
        words = ["step 0: gradient of", "not finite"]
    assert all(w in said for w in words), said


# --- checkpoints ----------------------------------------------------------------------------------


def _pipelined(plan_path: str, params: dict):
    import torch.distributed as dist

    from examples.llama_pipeline import build_model, loss
    from shardlang.runtime.apply import apply_plan, build_pipeline

    plan = shardlang.load(plan_path, params, world_size=dist.get_world_size())
    torch.manual_seed(0)
    applied = apply_plan(plan, plan.build(build_model))
    return applied, build_pipeline(applied, loss)


def _train_pipelined_and_save(plan_path: str, params: dict, directory: str) -> dict:
    """Two Adam steps through the schedule, then save; this rank's stages' full state."""
    from examples.llama_pipeline import example_input
    from shardlang.checkpoints.saving import save_checkpoint

    from .checkpoint_jobs import full_state

    applied, pipeline = _pipelined(plan_path, params)
    optimizer = torch.optim.Adam(applied.model.parameters(), lr=1e-2)
    for step in range(2):
        pipeline.step(example_input(8, torch.Generator().manual_seed(step)))
        optimizer.step()
        optimizer.zero_grad()
    save_checkpoint(applied.model, directory, optimizer)
    return full_state(applied.model, optimizer)


def _load_pipelined(plan_path: str, params: dict, directory: str) -> dict:
    from shardlang.checkpoints.loading import load_checkpoint

    from .checkpoint_jobs import full_state

    applied, _ = _pipelined(plan_path, params)
    optimizer = torch.optim.Adam(applied.model.parameters(), lr=1e-4)
    load_checkpoint(applied.model, directory, optimizer)
    return full_state(applied.model, optimizer)


@pytest.mark.distributed
def test_checkpoints_move_between_pipelined_and_plain_plans_bitwise(pools, tmp_path):
    """Saved under pp 2 x dp 2 (interleaved: two stages per rank), loaded under FSDP 4 (no pipeline) and
    back under the pipeline: every model and optimizer tensor bitwise; and the other way round."""
    params = SCHEDULES["interleaved"]
    from . import checkpoint_jobs as jobs
    from .test_checkpoints import assert_bitwise

    pipelined = str(ROOT / "plans" / "llama_pipeline.sl")
    plain = str(ROOT / "plans" / "hsdp.sl")
    directory = str(tmp_path / "pp")
    per_rank = pools(4).run(_train_pipelined_and_save, pipelined, params, directory)
    groups = [g for s in per_rank for k, g in s.items() if k == "optimizer.param_groups"]
    want = {k: v for s in per_rank for k, v in s.items() if k != "optimizer.param_groups"}
    assert len({k.split(".")[1] for k in want if k.startswith("model.")}) > 1  # stages of both ranks
    for rank, got in enumerate(
        pools(4).run(jobs.load_under, plain, {"shard": 4}, "examples.llama_pipeline", directory)
    ):
        got = {k: v for k, v in got.items() if k != "optimizer.param_groups"}
        assert got.keys() == want.keys(), rank
        assert_bitwise(got, want, f"plain, rank {rank}")
    for rank, got in enumerate(pools(4).run(_load_pipelined, pipelined, params, directory)):
        mine = {k: v for k, v in got.items() if k != "optimizer.param_groups"}
        assert mine and mine.keys() <= want.keys()
        assert_bitwise(mine, {k: want[k] for k in mine}, f"pp, rank {rank}")
    assert groups
    # The other way: a checkpoint of the plain plan loads into the stages.
    again = str(tmp_path / "plain")
    plain_state = pools(4).run(jobs.train_and_save, plain, {"shard": 4}, "examples.llama_pipeline", again)[0]
    for rank, got in enumerate(pools(4).run(_load_pipelined, pipelined, params, again)):
        mine = {k: v for k, v in got.items() if k != "optimizer.param_groups"}
        assert mine and all(k in plain_state for k in mine)
        assert_bitwise(mine, {k: plain_state[k] for k in mine}, f"plain to pp, rank {rank}")


# --- zero-bubble schedules --------------------------------------------------------------------------


def _without_torch_limits(job: Job):
    """Run `job` with shardlang's table of torch's limits emptied: what does torch itself do?"""
    from shardlang.compiler import torchlimits

    real = torchlimits.limits
    torchlimits.limits = lambda version=None: frozenset()
    try:
        return run(job)
    finally:
        torchlimits.limits = real


@pytest.mark.distributed
def test_zero_bubble_limit_matches_the_installed_torch(pools, tmp_path):
    """zbv with FSDP over dp 2 is SL301 where torchlimits says torch trains it wrong, and run anyway it
    fails the gradients check exactly then; without data parallelism it passes, where torch can run a V
    schedule over gloo at all (SL301 and a p2p failure where it cannot: torch 2.11)."""
    from shardlang.compiler.torchlimits import V_SCHEDULE_GLOO, ZERO_BUBBLE_DATA_PARALLEL, cannot

    path = ROOT / "plans" / "llama_pipeline.sl"
    params = {"schedule": "zbv", "per_rank": 2}
    found, _ = _lint(tmp_path, path.read_text().replace("$schedule", "zbv").replace("$per_rank", "2"))
    claimed = cannot(ZERO_BUBBLE_DATA_PARALLEL)
    assert any(code == "SL301" for code, _ in found) == claimed, found
    checks = tuple(c for c in shardlang.load(path, params).checks if c.name == "gradients")
    try:
        (gradients,) = pools(4).run(_without_torch_limits, Job(str(path), params, MODEL, None, checks))[0].checks
        passed, message = gradients.status == "pass", gradients.message
    except WorkerError as e:  # torch 2.11 over gloo does not get as far as a wrong gradient: its p2p fails
        passed, message = False, str(e)
    assert passed != claimed, message

    alone = tmp_path / "zbv.sl"
    alone.write_text(
        "mesh world = cpu[pp=2]\npipeline on world.pp { split layers.* into auto; schedule = zbv; "
        "microbatches = 4; stages_per_rank = 2 }\nverify gradients(steps=1, batch=8)\n"
    )
    job = Job(str(alone), {}, MODEL, None, shardlang.load(alone).checks)
    if cannot(V_SCHEDULE_GLOO):  # torch 2.11 cannot run a V schedule over gloo at all
        found, _ = _lint(tmp_path, alone.read_text(), world=2)
        assert [code for code, _ in found] == ["SL301"], found
        with pytest.raises(WorkerError, match="Pair is not connected"):
            pools(2).run(_without_torch_limits, job)
        return
    report = pools(2).run(run, job)[0]
    assert report.ok, [c.message for c in report.checks]


@pytest.mark.distributed
def test_init_pp_writes_a_pipeline_that_passes_every_check(tmp_path):
    """`shardlang init --pp 2`: the stack's blocks in two stages under 1F1B, FSDP inside each stage over
    dp, linted with the step and applied at world 4 with every check on CPU workers."""
    from .conftest import shardlang_cli

    out = tmp_path / "pp.sl"
    done = shardlang_cli("init", MODEL, "--pp", "2", "-o", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "linted clean and applied at world 4 on CPU" in done.stdout
    text = out.read_text()
    assert "mesh world = auto[pp=2, dp=auto]" in text
    assert "pipeline on world.pp {\n    split layers.* into auto\n    schedule = 1f1b\n}" in text


STREAMS = ROOT / "tests" / "fixtures" / "pipelines" / "streams.py"
STREAMS_PLAN = """shardlang 1
mesh world = cpu[pp=2, dp=auto]
pipeline on world.pp {
    split layers.* into auto
    schedule = 1f1b
}
fully_shard on world.dp {
    each layers.*
}
init meta
"""


def _lint_streams(tmp_path, fixture: str) -> tuple[str, int, str]:
    """STREAMS_PLAN linted at world 4 against the streams fixture `fixture`: the model file, lint's exit and
    what it printed."""
    from .conftest import shardlang_cli

    model = str(STREAMS.parent / fixture)
    path = tmp_path / "streams.sl"
    path.write_text(STREAMS_PLAN)
    done = shardlang_cli("lint", str(path), model, "--world", "4")
    return model, done.returncode, done.stdout + done.stderr


@pytest.mark.distributed
def test_a_model_that_widens_its_embedding_before_the_stack_pipelines(pools, tmp_path):
    """DeepSeek V4's shape (transformers 5.24): the embedding widened into streams before the stack, the
    head's dtype read in the forward. A later stage's embedding, held by the first stage, gives zeros of the
    embedding's own shape (it gave the received streams, which the model then widened again), and the head,
    held by the last, answers for its weight (it raised AttributeError on the first stage)."""
    path = tmp_path / "streams.sl"
    path.write_text(STREAMS_PLAN)
    plan = shardlang.load(path)
    report = pools(4).run(run, Job(str(path), {}, str(STREAMS), None, plan.checks))[0]
    assert report.ok, [c.message for c in report.checks] + [d.message for d in report.diagnostics]
    assert {c.check: c.status for c in report.checks}["gradients"] == "pass"


@pytest.mark.distributed
def test_blocks_that_carry_more_than_the_activation_are_refused_at_the_pipeline(tmp_path):
    """Hunyuan V4's blocks return the activation and the top-k indices the next block takes: a stage sends
    one tensor. lint's step says so at the pipeline (not at the block's unit), and `init --pp 2` leaves the
    pipeline out saying why."""
    from .conftest import shardlang_cli

    model, status, said = _lint_streams(tmp_path, "carrying.py")
    assert status == 1 and "streams.sl:3:1: error[SL220] the simulated training step of the pipeline stops: " in said
    assert "the blocks return a tuple (float32 tensor, int64 tensor)" in said
    out = tmp_path / "init.sl"
    done = shardlang_cli("init", model, "--pp", "2", "--dp", "1", "--no-check", "-o", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    text = out.read_text()
    assert "pipeline on" not in text and "mesh world = auto[dp=1]" in text
    assert "# --pp 2 asked for, but lint's simulated step of the pipeline stops: a pipeline stage sends" in text


@pytest.mark.distributed
def test_what_the_step_could_not_reach_apply_finds_and_init_leaves_the_pipeline_out(tmp_path):
    """Longformer reads a value of its input before its blocks: lint's step of the pipeline runs it on a
    stand-in (ones), and what raises after that guess is no finding (a note: it raised SL220 at the module, a
    false alarm where the pipeline could run). init's apply then finds the blocks' tuple, and init leaves the
    pipeline out and passes without it."""
    from .conftest import shardlang_cli

    model, status, said = _lint_streams(tmp_path, "reading.py")
    said = " ".join(said.split())
    assert status == 0, said
    assert "the step stopped: after _local_scalar_dense in the model's own forward read a value fake" in said, said
    out = tmp_path / "init.sl"
    done = shardlang_cli("init", model, "--pp", "2", "--dp", "1", "-o", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "apply found that the pipeline cannot run; leaving it out" in done.stderr
    text = out.read_text()
    assert "pipeline on" not in text and "# --pp 2 asked for, but apply found that a pipeline stage sends" in text


def test_a_wrapped_error_is_told_by_what_it_was_raised_from():
    """torch's stages wrap what their backward raised in "Failed to run stage backward:" and the tensors'
    shapes on the lines below: the first line alone said nothing of what went wrong."""
    from shardlang.launch import raised

    try:
        try:
            raise AttributeError("'FSDPParam' object has no attribute '_unsharded_param'")
        except AttributeError as e:
            raise RuntimeError("\n        Failed to run stage backward:\n        Stage output: Tensor(...)\n") from e
    except RuntimeError as e:
        wrapped = e
    assert raised.summary(wrapped) == (
        "RuntimeError: Failed to run stage backward: AttributeError: 'FSDPParam' object has no attribute "
        "'_unsharded_param'"
    )
    assert raised.cause_saying(wrapped, "'FSDPParam'") == "'FSDPParam' object has no attribute '_unsharded_param'"
    assert raised.cause_saying(wrapped, "a pipeline stage") is None


@pytest.mark.distributed
def test_experts_whose_float32_grouped_mm_fake_tensors_refuse_pipeline_clean(tmp_path):
    """Qwen3-MoE's experts run torch._grouped_mm in float32, which the meta kernel refuses (CUDA's does;
    CPU's takes it): lint's pipelined step runs it on stand-ins as the plain step does, and says so. It
    raised, a false alarm at the experts (Sarvam's MLA in the zoo, issue 41)."""
    pytest.importorskip("transformers")
    from .conftest import shardlang_cli

    path = tmp_path / "moe_pipeline.sl"
    path.write_text(
        "shardlang 1\nmesh world = auto[pp=2, dp=auto]\n"
        "pipeline on world.pp {\n    split before model.layers.1\n    microbatches = 4\n}\n"
        "fully_shard on world.dp {\n    each model.layers.*\n}\n"
    )
    done = shardlang_cli("lint", str(path), str(ROOT / "examples" / "hf_qwen3_moe.py"), "--world", "2")
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "stage by stage, for each of the 2 pp ranks; torch._grouped_mm ran in float32 in model.layers.0" in said


@pytest.mark.distributed
@pytest.mark.parametrize(("fixture", "module", "stage"), [("late.py", "late", 1), ("early.py", "extend", 0)])
def test_a_module_declared_on_the_other_side_of_the_stack_goes_where_it_runs(pools, tmp_path, fixture, module, stage):
    """OPT declares its final_layer_norm before its layers and runs it after them; Phi-4 multimodal declares
    `embed_tokens_extend` after its blocks and runs it before them. The traced order puts each on the stage
    where it runs: lint is clean and apply's gradients match the unsharded model's. Declaration order put
    them on the other stage (the last stage's blocks had no gradient, or the first block got token ids), and
    the pipeline was refused (SL220)."""
    from shardlang.compiler.lint import lint
    from shardlang.compiler.trace import trace_order
    from shardlang.runtime.modelfile import load_model_file

    model_path, status, said = _lint_streams(tmp_path, fixture)
    assert status == 0 and "error[" not in said, said
    model_file = load_model_file(model_path)
    order = trace_order(model_file.build_on_meta(), model_file.example_input)
    plan = shardlang.load(tmp_path / "streams.sl")
    linted = lint(plan, model_file.build_on_meta(), 4, order=order)
    assert linted.resolution.stages.stage_of(module) == stage
    job = Job(str(tmp_path / "streams.sl"), {}, model_path, None, plan.checks, order=order)
    report = pools(4).run(run, job)[0]
    assert report.ok, [c.message for c in report.checks] + [d.message for d in report.diagnostics]
    assert {c.check: c.status for c in report.checks}["gradients"] == "pass"


@pytest.mark.distributed
def test_explain_places_a_module_where_it_runs_too(tmp_path):
    """explain traces the order for a pipeline as lint and apply do: OPT's shape is predicted stage by stage
    (its pipelined step raised at the module before)."""
    from .conftest import shardlang_cli

    path = tmp_path / "streams.sl"
    path.write_text(STREAMS_PLAN)
    done = shardlang_cli("explain", str(path), str(STREAMS.parent / "late.py"), "--world", "4", "--format", "json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "runs after the blocks" not in done.stdout and '"pipeline"' in done.stdout


def test_without_the_order_modules_run_in_a_pipeline_places_them_as_declared():
    """No trace (a model file without example_input, or lint called without `order`): the declaration order
    places the modules outside the stack, and the runtime refuses one that runs on the other side
    (PassThrough's RUNS_EARLY and ONE_ACTIVATION say so)."""
    from shardlang.compiler.resolve import resolve
    from shardlang.compiler.trace import trace_order
    from tests.fixtures.pipelines import early, late

    plan = shardlang.loads(STREAMS_PLAN)
    for fixture, module, declared in ((late, "late", 0), (early, "extend", 1)):
        model = fixture.build_model()
        resolution, _ = resolve(plan, model, 2)
        assert resolution.stages.stage_of(module) == declared
        resolution, _ = resolve(plan, model, 2, trace_order(model, fixture.example_input))
        assert resolution.stages.stage_of(module) == 1 - declared


@pytest.mark.distributed
def test_blocks_that_wrap_their_activation_pipeline(pools, tmp_path):
    """TAPAS's layers return `(hidden_states,)`, RWKV's `(hidden_states, None, None)`: a stage sends the
    activation, and a block another stage holds hands the model the same wrapping (it handed the bare
    tensor, which the model unwrapped wrong; both were refused before). lint is clean, and apply's gradients
    match the unsharded model's."""
    from .conftest import shardlang_cli

    path = tmp_path / "streams.sl"
    path.write_text(STREAMS_PLAN)
    model = str(STREAMS.parent / "wrapped.py")
    done = shardlang_cli("lint", str(path), model, "--world", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    report = pools(4).run(run, Job(str(path), {}, model, None, shardlang.load(path).checks))[0]
    assert report.ok, [c.message for c in report.checks] + [d.message for d in report.diagnostics]
    assert {c.check: c.status for c in report.checks}["gradients"] == "pass"
