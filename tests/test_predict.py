"""The compiler's predicted layouts (compiler/predict.py) against what torch does: every built-in style,
run in a simulated world (runtime/simulated.py), places each tensor as predict's table says; a `use`
style is predicted from what it does there, not from its base class, and is "not predicted" where it
was not or could not be run; SL204 compares only predicted layouts; the placements check counts what it
compared. One process: the styles run in a forked child with a fake process group."""

import importlib
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import shardlang
from shardlang.compiler import program as p
from shardlang.compiler.lint import lint
from shardlang.compiler.lower import lower
from shardlang.compiler.predict import PLAIN, Placed, unknown
from shardlang.frontend import ir
from shardlang.runtime.simulated import observe_steps, observe_user_styles
from shardlang.runtime.values import import_path
from shardlang.verification import placements

from .conftest import ROOT


class ScaledEmbedding(nn.Embedding):
    """An embedding with a buffer beside its weight (Gemma's embed_scale): distribute_module replicates it."""

    def __init__(self):
        super().__init__(16, 8)
        self.register_buffer("scale", torch.tensor(2.0))


class Everything(nn.Module):
    """A module of each kind the built-in styles apply to."""

    def __init__(self):
        super().__init__()
        self.emb = ScaledEmbedding()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Embedding(16, 8)
        self.rms = nn.RMSNorm(8)


def _model(entry: str) -> nn.Module:
    module, _, name = entry.partition(":")
    with torch.device("meta"):
        return getattr(importlib.import_module(module), name)() if module else Everything()


def _tp_only(path: str) -> str:
    """A plan file without its fully_shard block and init (the table is for tensor parallelism)."""
    text = (ROOT / path).read_text()
    return re.sub(r"^fully_shard on .*?^}$", "", text, flags=re.MULTILINE | re.DOTALL).replace("init meta", "")


BUILTIN = {
    "linear": (
        "mesh world = cpu[tp=auto]\nparallelize on world.tp { net1 : colwise; net2 : rowwise }",
        "examples.mlp:build_model",
    ),
    "embedding_colwise": (
        "mesh world = cpu[tp=auto]\nparallelize on world.tp { embedding : colwise; fc : rowwise }",
        "tests.models:embed",
    ),
    "embedding_rowwise": (
        "mesh world = cpu[tp=auto]\nparallelize on world.tp { embedding : rowwise; fc : colwise }",
        "tests.models:embed",
    ),
    "every_kind": (
        """mesh world = cpu[tp=auto]
        parallelize on world.tp {
            emb  : colwise
            norm : sequence_parallel
            up   : colwise_gather_output
            down : rowwise_split_input
            head : rowwise(input=replicate)
            rms  : distribute(input=shard(1))
        }""",
        "",
    ),
    "prepare_and_sequence_parallel": (
        """mesh world = cpu[tp=auto]
        parallelize on world.tp {
            mlp    : prepare_input(input=shard(0), desired=replicate)
            mlp.w1 : colwise
            mlp.w2 : rowwise(output=partial)
        }
        parallelize mlp on world.tp { root : prepare_output(output=partial, desired=shard(0)) }
        parallelize on world.tp { norm : sequence_parallel(dim=0, local_output=true) }""",
        "tests.models:seq_mlp",
    ),
    "distribute_buffers": (
        "mesh world = cpu[tp=auto]\nparallelize on world.tp { standardize : distribute; net1 : colwise; net2 : rowwise }",
        "examples.buffers:build_model",
    ),
    "transformers_styles": (_tp_only("plans/transformers_styles.sl"), "examples.fused:build_model"),
    "gpt2_conv1d": (_tp_only("plans/hf/gpt2.sl"), "examples.hf_gpt2:build_model"),
}


def _run_in_simulated_world(plan, model, world: int) -> dict[str, Placed]:
    """Every tensor's layout after running the program's tensor-parallel steps, each on its own meta copy."""
    program = lower(plan, lint(plan, model, world).resolution, world)
    steps = [s for s in program.steps if isinstance(s, (p.Parallelize, p.Distribute, p.UserStyle))]
    imported = {u.alias: import_path(u.path) for u in plan.uses}
    layouts: dict[str, Placed] = {}
    for step, seen in zip(steps, observe_steps(plan, program, model, imported, world, steps)):
        assert seen.failure is None, seen.failure
        prefix = f"{step.module}." if step.module else ""
        for name, placed in seen.tensors:
            if placed.mesh is not None:
                assert layouts.get(prefix + name, PLAIN).mesh is None, f"two steps place {prefix}{name}"
                layouts[prefix + name] = placed
            layouts.setdefault(prefix + name, placed)
    return layouts


def _layouts(predictions: dict[str, Placed]) -> dict[str, tuple]:
    return {name: (placed.mesh, placed.dims, placed.placements) for name, placed in predictions.items()}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", sorted(BUILTIN))
def test_every_builtin_style_places_tensors_as_the_table_predicts(case, world):
    text, entry = BUILTIN[case]
    plan, model = shardlang.loads(text), _model(entry)
    predicted = lint(plan, model, world).predictions
    assert all(placed.known for placed in predicted.values())
    assert any(placed.mesh is not None for placed in predicted.values())
    ran = _run_in_simulated_world(plan, model, world)  # tensors no step acts on stay plain
    assert _layouts({name: ran.get(name, PLAIN) for name in predicted}) == _layouts(predicted)


def _observed_lint(plan, model, world: int):
    program = lower(plan, lint(plan, model, world).resolution, world)
    imported = {u.alias: import_path(u.path) for u in plan.uses}
    return lint(plan, model, world, observe_user_styles(plan, program, model, imported, world))


@pytest.mark.distributed
def test_use_styles_for_conv1d_are_predicted_from_what_they_do_not_their_base_class():
    """ColwiseParallel/RowwiseParallel subclasses for GPT-2's Conv1D (weight [in, out]) shard the weight's dim 1
    and dim 0: as the built-in *_conv1d styles do, not as nn.Linear's colwise (Shard(0)) would."""
    model = _model("examples.hf_gpt2:build_model")
    use = shardlang.load(ROOT / "plans" / "hf" / "gpt2_use.sl")
    plain = lint(use, model, 4).predictions["transformer.h.0.mlp.c_fc.weight"]
    assert not plain.known and "only apply runs" in plain.note
    predicted = _observed_lint(use, model, 4).predictions
    assert str(predicted["transformer.h.0.mlp.c_fc.weight"]) == "world[dp, tp] (Shard(0), Shard(1))"
    assert str(predicted["transformer.h.0.mlp.c_fc.bias"]) == "world[dp, tp] (_StridedShard(dim=0, sf=2), Shard(0))"
    assert str(predicted["transformer.h.0.mlp.c_proj.weight"]) == "world[dp, tp] (_StridedShard(dim=0, sf=2), Shard(0))"
    assert "simulated world" in predicted["transformer.h.0.mlp.c_proj.weight"].note
    builtin = lint(shardlang.load(ROOT / "plans" / "hf" / "gpt2.sl"), model, 4).predictions
    assert _layouts(predicted) == _layouts(builtin)


@pytest.mark.distributed
def test_a_subclass_that_shards_unlike_its_base_class_is_predicted_as_it_shards():
    model = _model("tests.faults.seq_norm:build_model")
    text = (
        "use tests.faults.styles.{} as sp\nmesh world = cpu[tp=auto]\n"
        "parallelize on world.tp {{ norm : sp; mlp.w1 : colwise; mlp.w2 : rowwise }}\n"
    )
    sharding = _observed_lint(shardlang.loads(text.format("ShardingSequenceParallel")), model, 2).predictions
    plain = _observed_lint(shardlang.loads(text.format("PlainSequenceParallel")), model, 2).predictions
    assert sharding["norm.weight"].placements == (ir.Shard(0),)
    assert plain["norm.weight"].placements == (ir.Replicate(),)


@pytest.mark.distributed
def test_a_use_style_that_cannot_run_on_meta_is_not_predicted():
    model = _model("examples.mlp:build_model")
    plan = shardlang.loads(
        "use tests.faults.styles.colwise_reading_values as cw\nmesh world = cpu[tp=auto]\n"
        "parallelize on world.tp { net1 : cw; net2 : rowwise }\n"
    )
    predicted = _observed_lint(plan, model, 2).predictions
    assert not predicted["net1.weight"].known and not predicted["net1.bias"].known
    assert "could not be run in a simulated world" in predicted["net1.weight"].note
    assert "meta" in predicted["net1.weight"].note
    assert predicted["net2.weight"].placements == (ir.Shard(1),)


@pytest.mark.distributed
def test_a_use_style_that_hangs_costs_its_prediction_not_the_run():
    model = _model("examples.mlp:build_model")
    plan = shardlang.loads(
        "use time.sleep as sleeps\nmesh world = cpu[tp=auto]\nparallelize on world.tp { net1 : sleeps; net2 : rowwise }\n"
    )
    program = lower(plan, lint(plan, model, 2).resolution, 2)
    steps = [s for s in program.steps if isinstance(s, p.UserStyle)]
    slow = {"sleeps": lambda module, mesh: __import__("time").sleep(60)}
    (seen,) = observe_steps(plan, program, model, slow, 2, steps, timeout_s=2)
    assert seen.failure == "no result within 2 s"


def colwise_every_linear_below(module, mesh):
    """A `use` style (for test_a_tensor_two_rules_would_place_is_not_predicted): every nn.Linear child column-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    for child in module.children():
        if isinstance(child, nn.Linear):
            parallelize_module(child, mesh, ColwiseParallel())


@pytest.mark.distributed
def test_a_tensor_two_rules_would_place_is_not_predicted():
    """Which of a `use` style above and a built-in rule below places a tensor depends on their order."""
    model = _model("tests.models:seq_mlp")
    plan = shardlang.loads(
        "use tests.test_predict.colwise_every_linear_below as below\nmesh world = cpu[tp=auto]\n"
        "parallelize on world.tp { mlp : below; mlp.w1 : rowwise }\n"
    )
    predicted = _observed_lint(plan, model, 2).predictions
    assert not predicted["mlp.w1.weight"].known
    assert (
        predicted["mlp.w1.weight"].note
        == "the rules on 'mlp.w1' and 'mlp' would both place it, one of them a `use` style"
    )
    assert predicted["mlp.w2.weight"].placements == (ir.Shard(0),)
    assert predicted["norm.weight"] == PLAIN


TIED = "{uses}mesh world = cpu[tp=auto]\nparallelize on world.tp {{ embedding : colwise; fc : {fc} }}\n"


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("uses", "fc", "sl204_at_lint", "sl204_at_apply"),
    [
        ("", "rowwise", False, False),
        ("", "colwise", True, True),
        ("use torch.distributed.tensor.parallel.RowwiseParallel as rw\n", "rw", False, False),
        ("use torch.distributed.tensor.parallel.ColwiseParallel as cw\n", "cw", False, True),
    ],
    ids=["builtin-alike", "builtin-apart", "use-alike", "use-apart"],
)
def test_sl204_compares_tied_parameters_only_where_both_are_predicted(uses, fc, sl204_at_lint, sl204_at_apply):
    """A tied weight whose second module has a `use` style: plain lint cannot tell its layout (no SL204);
    apply, having run the style, can (SL204 only where it places the weight differently)."""
    model = _model("examples.tied:build_model")
    plan = shardlang.loads(TIED.format(uses=uses, fc=fc))
    assert ("SL204" in {d.code for d in lint(plan, model, 2).diagnostics}) == sl204_at_lint
    assert ("SL204" in {d.code for d in _observed_lint(plan, model, 2).diagnostics}) == sl204_at_apply


def _check(predictions: dict[str, Placed]):
    model = nn.Linear(4, 4)
    ctx = SimpleNamespace(applied=SimpleNamespace(predictions=predictions), model=model)
    return placements.run(ctx, None)


def test_placements_check_counts_only_what_it_compared():
    why = "the `use` style 'x' could not be run in a simulated world: ValueError"
    none = _check({"weight": unknown(why), "bias": unknown(why)})
    assert none.status == "skipped" and f"2 not predicted ({why}): weight, bias" in none.message
    some = _check({"weight": PLAIN, "bias": unknown(why)})
    assert some.status == "pass" and some.message.startswith("1 of 2 tensors placed as predicted; 1 not predicted")
    wrong = _check({"weight": Placed("world", ("tp",), (ir.Shard(1),), note="what x did"), "bias": PLAIN})
    assert (
        wrong.status == "fail"
        and "weight: predicted world[tp] (Shard(1)) (what x did), got plain tensor" in wrong.message
    )
