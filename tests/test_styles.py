"""The built-in styles for transformers' layouts (docs/language.md §4.2, runtime/tpstyles.py): the shard
each rank holds, the printed program, the checks catching the layout torch's colwise would give a packed
layer, argument checks and SL202's help on layers they do not fit. plans/transformers_styles.sl itself
passes every check in tests/test_apply_cli.py."""

import pytest
import torch

import shardlang

from . import dist_jobs as jobs
from .conftest import ROOT


@pytest.mark.distributed
def test_each_rank_holds_the_slice_transformers_gives_it(pools):
    text = (ROOT / "plans" / "transformers_styles.sl").read_text().replace("init meta", "")
    (result, *_) = pools(4).run(jobs.transformers_styles_shard_as_transformers_does, text)
    assert result["placements"]["mlp.gate_up.weight"] == "('dp', 'tp') (Shard(dim=1), _StridedShard(dim=0, sf=2))"
    assert result["placements"]["ffn.fc.weight"] == "('dp', 'tp') (Shard(dim=0), Shard(dim=1))"
    # torch's colwise on [gate; up] gives rank 0 all of gate: the model pairs gate with gate
    assert result["plain_colwise"] == [("gradients", "fail")]


def test_predicted_placements_of_each_style():
    import examples.fused as fused

    plan = shardlang.load(ROOT / "plans" / "transformers_styles.sl")
    with torch.device("meta"):
        model = fused.build_model()
    from shardlang.compiler.lint import lint

    predicted = {name: str(placed) for name, placed in lint(plan, model, 4).predictions.items()}
    assert predicted == {
        "mlp.gate_up.weight": "world[dp, tp] (Shard(1), _StridedShard(dim=0, sf=2))",
        "mlp.gate_up.bias": "world[dp, tp] (Shard(0), Replicate())",
        "mlp.down.weight": "world[dp, tp] (Shard(0), Shard(1))",
        "mlp.down.bias": "world[dp, tp] (Shard(0), Replicate())",
        "attn.qk.weight": "world[dp, tp] (_StridedShard(dim=0, sf=2), Shard(0))",
        "attn.head_norm.weight": "world[dp, tp] (Shard(0), Replicate())",
        "attn.out.weight": "world[dp, tp] (Shard(0), Shard(1))",
        "ffn.fc.weight": "world[dp, tp] (Shard(0), Shard(1))",
        "ffn.fc.bias": "world[dp, tp] (_StridedShard(dim=0, sf=2), Shard(0))",
        "ffn.proj.weight": "world[dp, tp] (_StridedShard(dim=0, sf=2), Shard(0))",
        "ffn.proj.bias": "world[dp, tp] (Shard(0), Replicate())",
        "head.gather.weight": "world[dp, tp] (_StridedShard(dim=0, sf=2), Shard(0))",
        "head.gather.bias": "world[dp, tp] (_StridedShard(dim=0, sf=2), Shard(0))",
        "head.split.weight": "world[dp, tp] (Shard(0), Shard(1))",
        "head.split.bias": "world[dp, tp] (Shard(0), Replicate())",
    }


def test_sl202_says_which_style_fits():
    import examples.fused as fused

    plan = shardlang.load(ROOT / "tests" / "fixtures" / "lint" / "sl202_transformers_styles.sl")
    with torch.device("meta"):
        model = fused.build_model()
    found = plan.lint(model, 4)
    assert [d.code for d in found] == ["SL202"] * 5
    helps = {d.message.split("'")[1]: d.help[0] for d in found}
    assert "use colwise_conv1d or rowwise_conv1d" in helps["ffn.fc"]
    assert "match their submodules instead" in helps["mlp"]
    assert "Linear takes colwise" in helps["mlp.down"]
    assert "parameters below it: qk.weight" in helps["attn"]
    assert "do not split into 3 equal parts" in helps["head.gather"]


def test_an_embedding_with_parameters_below_it_takes_no_linear_style():
    """Inkling's embedding normalises its output with a norm of its own: torch's RowwiseParallel would
    register `embed_norm.weight` as a parameter of the embedding (a KeyError in apply) and, were it laid out,
    run the norm on partial sums. SL202 at the rule, statically."""

    class NormedEmbedding(torch.nn.Embedding):
        def __init__(self):
            super().__init__(16, 8)
            self.norm = torch.nn.LayerNorm(8)

        def forward(self, ids):
            return self.norm(super().forward(ids))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = NormedEmbedding()

    plan = shardlang.loads("mesh world = cpu[tp=2]\nparallelize on world.tp { embed : rowwise(input=replicate) }\n")
    found = plan.lint(Model(), 2)
    assert [d.code for d in found] == ["SL202"], found
    assert "its submodules hold parameters (norm.weight, norm.bias)" in found[0].help[0]


@pytest.mark.parametrize(
    ("style", "message"),
    [
        ("packed_colwise(parts=1)", "expected an integer of at least 2"),
        ("colwise_gather_output(output=shard(1))", "unknown style argument 'output'"),
        ("replicated_with_grad_allreduce(dim=1)", "unknown style argument 'dim'"),
    ],
)
def test_style_arguments_are_checked(style, message):
    with pytest.raises(shardlang.PlanError, match=message):
        shardlang.loads(f"mesh world = cpu[tp=2]\nparallelize on world.tp {{ a : {style} }}\n")


def test_fsdp_over_a_packed_weight_needs_its_columns_to_divide():
    """FSDP2 shards a packed weight on dim 1, and a dim other than 0 only evenly: SL301 before apply."""
    import examples.fused as fused

    plan = shardlang.load(ROOT / "plans" / "transformers_styles.sl")
    with torch.device("meta"):
        model = fused.build_model()
    (found,) = [d for d in plan.lint(model, 1024) if d.is_error]  # dp 512
    assert found.code == "SL301" and "mlp.gate_up.weight has 128" in found.message
    assert not [d for d in plan.lint(model, 256) if d.is_error]  # dp 128


def test_default_layouts_are_torchs_and_every_style_built_like_torchs_takes_them():
    """compiler.styles.DEFAULT_LAYOUTS, the one table lint and lint's step read for a rule that gives no layout,
    says what torch's ColwiseParallel, RowwiseParallel and SequenceParallel take and give; the Conv1D and
    packed styles (runtime.tpstyles) take the same defaults, as their colwise and rowwise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from shardlang.compiler.styles import DEFAULT_INPUTS, DEFAULT_LAYOUTS
    from shardlang.explain.rehearsal import TAKES
    from shardlang.runtime import tpstyles
    from shardlang.runtime.values import to_torch

    def torch_of(name):
        return to_torch(DEFAULT_LAYOUTS[name].input), to_torch(DEFAULT_LAYOUTS[name].output)

    torchs = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}
    for name, style in torchs.items():
        assert torch_of(name) == (style.input_layouts[0], style.output_layouts[0])
    assert torch_of("sequence_parallel") == (SequenceParallel().sequence_sharding[0],) * 2
    ours = {"colwise": tpstyles.ColwiseConv1DParallel(), "rowwise": tpstyles.RowwiseConv1DParallel()}
    for name, style in ours.items():
        assert torch_of(name) == (style.input_layouts, style.output_layouts)
    assert tpstyles.PackedColwiseParallel().input_layouts == torch_of("colwise")[0]
    assert TAKES is DEFAULT_INPUTS
    assert {name: str(layout) for name, layout in TAKES.items()} == {
        "colwise": "replicate",
        "rowwise": "shard(-1)",
        "sequence_parallel": "shard(1)",
    }
