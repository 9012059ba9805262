"""What the zoo (issue 41) found wrong in init's starter plans, and lint missed: init meta's initialisers
dispatched as transformers dispatches them (a vision tower's own `_init_weights`), the parameters they leave
unwritten (SL224, and init writing `init rank0` for them), mixed dtypes that fake kernels let through, and
init leaving out what lint's step finds cannot run (compiler.dropping). Fast lane but for the last tests,
which run init and lint's step in a forked child."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import zoo  # noqa: E402
from shardlang.compiler.dropping import Drops  # noqa: E402
from shardlang.compiler.initialisers import initialisation_calls  # noqa: E402
from shardlang.compiler.starter import init_plan  # noqa: E402
from shardlang.explain.unwritten import left_unwritten  # noqa: E402


def _meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return zoo.build(zoo.family(name))


def test_a_vision_tower_is_initialised_by_its_own_init_weights():
    """Gemma 3's SigLIP tower: from_config gives its position embedding std 1/sqrt(width) (0.125 at width
    64), not the language model's 0.02; init meta's calls, made on a model allocated on the CPU, do too."""
    torch.manual_seed(0)
    built = zoo.build(zoo.family("gemma3"))
    model = _meta("gemma3").to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for _, call, _ in initialisation_calls(model):
            call()
    name = "model.vision_tower.embeddings.position_embedding.weight"
    want, got = dict(built.named_parameters())[name].std(), dict(model.named_parameters())[name].std()
    assert want > 0.08 and abs(got / want - 1) < 0.2, (float(want), float(got))


@pytest.mark.parametrize(
    "name, unwritten",
    [
        ("apertus", [f"model.layers.{i}.mlp.act_fn.alpha_{s}" for i in (0, 1) for s in "pn"]),
        ("nystromformer", ["cls.predictions.bias"]),
        ("llama", []),
        ("gemma3", []),
    ],
)
def test_the_parameters_init_meta_leaves_unwritten(name, unwritten):
    assert sorted(left_unwritten(_meta(name), None)) == sorted(unwritten)


def test_unwritten_parameters_make_init_write_rank0():
    model = _meta("apertus")
    text = init_plan(model, name="apertus", unwritten=left_unwritten(model, None))
    assert "\ninit rank0\n" in text and "\ninit meta" not in text
    assert "model.layers.0.mlp.act_fn.alpha_p" in text and "SL224" in text


def test_fake_kernels_refuse_mixed_dtypes_as_the_real_ones_do():
    from shardlang.explain.fakestep import StandIns, recording_fake_mode
    from shardlang.verification.comms import Calls

    mode = recording_fake_mode(Calls(), StandIns())
    a = mode.from_tensor(torch.ones(2, 3))
    b, weight = (mode.from_tensor(torch.ones(shape, dtype=torch.bfloat16)) for shape in ((3, 4), (3,)))
    with mode:
        assert (a.bfloat16() @ b).dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="same dtype"):
            torch.mm(a, b)
        assert torch.nn.functional.layer_norm(a.bfloat16(), (3,), weight.float()).dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="layer_norm of a float32 input"):
            torch.nn.functional.layer_norm(a, (3,), weight)


TP_TEXT = """shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize on world.tp {
    model.layers.*.self_attn.q_proj : colwise
    model.layers.*.mlp.down_proj    : rowwise
}

context_parallel on world.cp {
    each model.layers.*.self_attn
}

fully_shard on world.dp {
    each model.layers.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
"""


def test_what_an_error_at_a_line_leaves_out():
    line = {text.strip(): n for n, text in enumerate(TP_TEXT.splitlines(), 1)}
    drops = Drops().after(TP_TEXT, line["model.layers.*.mlp.down_proj    : rowwise"], "raises in module 'x'\nmore")
    assert drops.rules == {"model.layers.*.mlp.down_proj": "raises in module 'x'"}
    assert drops.after(TP_TEXT, line["model.layers.*.mlp.down_proj    : rowwise"], "again") is None  # once
    assert Drops().after(TP_TEXT, line["each model.layers.*.self_attn"], "mixes positions").cp == "mixes positions"
    unit = line["each model.layers.*"]
    first = Drops().after(TP_TEXT, unit, "Unsupported dtype BFloat16")
    assert first.mixed_precision and not first.units  # mixed precision goes first, then the unit
    assert first.after(TP_TEXT, unit, "still").units == {"model.layers.*": "still"}
    assert Drops().after(TP_TEXT, line["init meta"], "SL224") is None
    assert Drops().after(TP_TEXT, 99, "out of the text") is None


def test_init_writes_what_it_left_out_as_comments():
    model = _meta("llama")
    drops = Drops(
        rules={"model.layers.*.mlp.down_proj": "raises"},
        mixed_precision="Unsupported dtype BFloat16",
        units={"model.layers.*": "reads a weight outside its forward"},
    )
    text = init_plan(model, tp=2, name="llama", drops=drops)
    assert "    # model.layers.*.mlp.down_proj    : rowwise: left out (lint's simulated step: raises)\n" in text
    assert "mixed_precision(" not in text and "No mixed_precision" in text
    assert "each model.layers.*" not in text and "the root holds them" in text
    assert "model.layers.*.mlp.up_proj" in text and "tp=2" in text
    every = Drops(rules={key: "raises" for key in zoo_tp_keys(model)})
    fsdp_only = init_plan(model, tp=2, name="llama", drops=every)
    assert "mesh world = auto[dp=auto]\n" in fsdp_only  # no rule left: no tp dim (SL217)
    assert "found that none of its rules runs" in fsdp_only


def zoo_tp_keys(model) -> list[str]:
    from shardlang.compiler.starter import hf_tp_plan

    return list(hf_tp_plan(model))


@pytest.mark.distributed
def test_lint_finds_what_init_meta_leaves_unwritten(tmp_path, capsys, monkeypatch):
    from shardlang.cli.main import main

    model = _model_file(tmp_path, "apertus")
    plan = tmp_path / "apertus.sl"
    plan.write_text("shardlang 1\nmesh world = cpu[dp=2]\nfully_shard on world.dp { each model.layers.* }\ninit meta\n")
    assert main(["lint", str(plan), str(model), "--format", "json"]) == 1
    out = capsys.readouterr().out
    assert '"code": "SL224"' in out and "alpha_p" in out and '"line": 4' in out


@pytest.mark.distributed
def test_init_leaves_out_mixed_precision_where_the_model_cannot_run_bf16(tmp_path, capsys):
    """FNet's Fourier transform has no bf16 kernel: init's first plan fails lint's step in the unit holding
    it; the plan it writes has no mixed_precision, says why, and passes every check."""
    from shardlang.cli.main import main

    plan = tmp_path / "fnet.sl"
    assert main(["init", str(_model_file(tmp_path, "fnet")), "-o", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "init: left out mixed_precision: raises in module 'fnet.encoder.layer.0.fourier.self'" in out
    assert "linted clean and applied at world 2 on CPU" in out
    text = plan.read_text()
    assert "mixed_precision(" not in text and "# No mixed_precision (lint's simulated step" in text


def _model_file(tmp_path, name: str):
    from benchmarks.zoo.build import write_model_file

    return write_model_file(name, tmp_path / f"{name}.py")


@pytest.mark.distributed
def test_init_moves_on_when_the_init_check_alone_fails(tmp_path, capsys, monkeypatch):
    """`init meta with init_weights` where build_model() never calls init_weights fails its init check:
    init writes plain `init meta` instead, with a comment, and that plan passes every check."""
    from shardlang.cli.main import main

    from .conftest import ROOT

    monkeypatch.chdir(ROOT)
    plan = tmp_path / "plan.sl"
    assert main(["init", "tests/faults/uncalled_init_weights.py", "-o", str(plan)]) == 0
    captured = capsys.readouterr()
    assert "`init meta with init_weights` failed its init check" in captured.err
    assert "init: left out `init meta with init_weights`: its init check failed" in captured.out
    assert "linted clean and applied at world 2 on CPU" in captured.out
    text = plan.read_text()
    assert "\ninit meta\n" in text and "# Not `init meta with init_weights`: its init check failed" in text


def test_init_says_which_proposed_rules_went_with_one_left_out():
    """examples/mlp.py has no TP plan: init proposes net1 colwise and net2 rowwise, a group. Where lint's step
    leaves net2 out, net1 goes too, and init's output says so for each."""
    import importlib.util

    from shardlang.cli.commands.init import _partners_left_out

    from .conftest import ROOT

    spec = importlib.util.spec_from_file_location("mlp", ROOT / "examples" / "mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.device("meta"):
        model = module.build_model()
    text = init_plan(model, tp=2, name="mlp", drops=Drops(rules={"net2": "raises"}))
    assert "mesh world = auto[dp=auto]\n" in text  # no rule left: no tp dim
    assert _partners_left_out(text) == ["left out rule net1: it runs only with net2, left out: raises"]


def test_a_rule_of_the_models_own_tp_plan_left_out_takes_its_siblings():
    """transformers' Llama: lint's step leaving out the MLP's gate_proj (colwise) leaves out up_proj and
    down_proj with it, each saying why; the attention's rules stay (torch 2.11's fake step left out gate_proj
    but not up_proj, and apply failed on the split activation that plan made)."""
    from transformers import LlamaForCausalLM

    from examples.hf_llama import config

    with torch.device("meta"):
        model = LlamaForCausalLM(config())
    text = init_plan(model, tp=2, drops=Drops(rules={"model.layers.*.mlp.gate_proj": "it raises"}))
    rules = [line.split(":")[0].strip() for line in text.splitlines() if line.startswith("    model.layers")]
    assert "model.layers.*.self_attn.o_proj" in rules and not any(".mlp." in rule for rule in rules), text
    assert "it runs only with model.layers.*.mlp.gate_proj, left out: it raises" in text


def test_context_attentions_own_refusal_leaves_out_context_parallelism_wherever_it_points():
    """LayoutLM: the explicit mask is refused in `attention.self`, inside the attention the cp statement
    matches, and the diagnostic points at the fully_shard unit holding it: what init leaves out is the cp."""
    text = "shardlang 1\nmesh world = auto[dp=auto, cp=2]\ncontext_parallel on world.cp {\n    each a.*.attention\n}\n"
    text += "fully_shard on world[dp*cp] {\n    each a.*\n    mixed_precision(param=bf16, reduce=fp32)\n}\n"
    message = "raises in module 'a.0.attention.self': NotImplementedError: context parallelism takes attention without"
    drops = Drops().after(text, 6, message)
    assert drops.cp and drops.cp.startswith("raises in module 'a.0.attention.self'") and not drops.mixed_precision


def test_an_error_in_the_pipeline_block_leaves_out_the_pipeline_and_init_writes_no_pp_dim():
    from examples.llama_pipeline import build_model

    text = "shardlang 1\nmesh world = auto[pp=2, dp=auto]\npipeline on world.pp {\n    split layers.* into auto\n}\n"
    drops = Drops().after(text, 4, "the split makes 3 stages")
    assert drops.pp == "the split makes 3 stages" and Drops().after(text, 2, "x") is None  # the mesh: no feature
    assert drops.said() == ["left out pipeline parallelism: the split makes 3 stages"]
    assert drops.after(text, 4, "again") is None  # left out already
    with torch.device("meta"):
        model = build_model()
    written = init_plan(model, pp=2, drops=drops)
    assert "mesh world = auto[dp=auto]" in written and "pipeline on" not in written
    assert "--pp 2 asked for, but the split makes 3 stages" in written


def test_a_tied_weight_written_through_either_name_is_written():
    """torchtitan's Llama3 1B ties tok_embeddings to lm_head and its init_states writes lm_head's: SL224
    said tok_embeddings.weight was left unwritten (allocating the fake copy had untied the two)."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = torch.nn.Embedding(8, 4)
            self.lm_head = torch.nn.Linear(4, 8, bias=False)
            self.lm_head.weight = self.tok_embeddings.weight

        def init_states(self):
            torch.nn.init.normal_(self.lm_head.weight)

    with torch.device("meta"):
        model = Tied()
    assert left_unwritten(model, "init_states") == []


def test_whole_parameters_meeting_a_piece_get_their_gradients_summed():
    """Apertus' xIELU activation holds learned scalars and runs between the colwise up_proj and the rowwise
    down_proj: lint's step says its whole parameters meet a piece of its input (SL222, at the unit holding
    it). init answers by adding `replicated_with_grad_allreduce` for every block's, not by dropping the unit;
    the zoo's apertus then passes every check at tp 2 (and failed before, on torch 2.11 and 2.13 alike)."""
    message = (
        "the simulated training step hands module 'model.layers.0.mlp.act_fn' (XIELUActivation) (and 1 more "
        "like it: model.layers.1.mlp.act_fn), whose parameters (alpha_p, alpha_n) are whole on every rank, a "
        "piece of its input: each rank's gradient of them is its piece's share, and nothing sums the shares"
    )
    unit = {text.strip(): n for n, text in enumerate(TP_TEXT.splitlines(), 1)}["each model.layers.*"]
    drops = Drops().after(TP_TEXT, unit, message)
    assert list(drops.summed) == ["model.layers.*.mlp.act_fn"] and not drops.units and not drops.mixed_precision
    assert drops.after(TP_TEXT, unit, message).mixed_precision  # asked again: the usual order resumes
    fsdp_only = TP_TEXT.replace("parallelize on world.tp", "parallelize on world.ep")
    assert not Drops().after(fsdp_only, unit, message).summed  # nothing to sum over without tp
    text = init_plan(_meta("apertus"), tp=2, name="apertus", drops=drops)
    assert "    model.layers.*.mlp.act_fn       : replicated_with_grad_allreduce\n" in text
    assert "# model.layers.*.mlp.act_fn: added: lint's simulated step found its whole parameters" in text


def test_a_shape_error_in_a_module_no_rule_governs_leaves_out_the_rules_around_it():
    """NeoMME's exclusive self-attention scales each head by its own `alpha`, kept whole beside the heads its
    attention's colwise q/k/v (transformers' own tp_plan) split: the step raises a shape error there, at the
    unit holding it. init used to leave out the units, then mixed precision, and wrote a plan that failed
    lint and apply; it now leaves out the rules of the attention around it, and the MLP's stay."""
    message = (
        "the simulated training step raises in module 'model.layers.0.self_attn.exclusive' (Exclusive), in its "
        "forward: RuntimeError: Attempting to broadcast a dimension of length 2 at -2! Mismatching argument"
    )
    unit = {text.strip(): n for n, text in enumerate(TP_TEXT.splitlines(), 1)}["each model.layers.*"]
    drops = Drops().after(TP_TEXT, unit, message)
    assert list(drops.rules) == ["model.layers.*.self_attn.q_proj"] and not drops.units and not drops.mixed_precision
    again = drops.after(TP_TEXT, unit, message)  # then the block's rules around it
    assert list(again.rules) == ["model.layers.*.self_attn.q_proj", "model.layers.*.mlp.down_proj"]
    assert again.after(TP_TEXT, unit, message).mixed_precision  # none left above it: the usual order resumes
    dtype = message.replace(
        "Attempting to broadcast a dimension of length 2 at -2! Mismatching argument", "mixed dtype"
    )
    assert Drops().after(TP_TEXT, unit, dtype).mixed_precision  # no shape error: not the split's
    at_root = message.replace("model.layers.0.self_attn.exclusive", "norm")
    assert Drops().after(TP_TEXT, unit, at_root).mixed_precision  # the root holds every rule: never all taken


def test_transformers_reads_no_packed_sequences_in_fake_positions_it_cannot_read():
    """On fake position ids transformers assumed packed sequences and built an explicit mask the real run
    never has (Youtu's grouped keys then raised in the unsharded model and lint's step stopped with no
    finding): the step reads positions whose values fake tensors kept, and takes the rest as one sequence."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardlang.explain.fakestep import positions_as_on_real_tensors

    masking = pytest.importorskip("transformers.masking_utils")
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    original = masking.find_packed_sequence_indices
    with positions_as_on_real_tensors():
        assert masking.find_packed_sequence_indices(packed).tolist() == [[0, 0, 0, 1, 1, 1]]  # real: read
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # as lint's step has it
            assert masking.find_packed_sequence_indices(torch.arange(6)[None]) is None
            kept = mode.from_tensor(packed)
            kept.constant = packed
            assert masking.find_packed_sequence_indices(kept).tolist() == [[0, 0, 0, 1, 1, 1]]
    assert masking.find_packed_sequence_indices is original


def test_a_uniform_draw_the_model_branches_on_is_drawn_for_real_and_again_for_the_plans_model():
    """SeamlessM4T's LayerDrop (`if torch.rand([]) < layerdrop`) could not be read on a fake tensor; its stand-in
    of ones skipped every layer and the step stopped at a guess, checking nothing (the zoo's planted mistake
    passed lint). A draw of one value is made for real, and redrawn alike for the plan's model."""
    from shardlang.explain.fakestep import StandIns, recording_fake_mode
    from shardlang.verification.comms import Calls

    stand_ins = StandIns()
    fake = recording_fake_mode(Calls(), stand_ins)
    with fake:
        first = [float(torch.rand([])) for _ in range(3)]
        fake.redraw()
        assert [float(torch.rand([])) for _ in range(3)] == first and len(set(first)) == 3
        assert bool(torch.rand([]) < 2.0) and torch.rand(4, 4).constant is None  # only single values are drawn
    assert not stand_ins.seen  # nothing was guessed


def test_a_sum_of_partial_outputs_needs_a_rule_inside_that_makes_them():
    """Inkling's tp_plan sums its shared experts' output (`all_reduce`), partial through the colwise and
    rowwise rules on gate_proj/up_proj/down_proj, which are parameters of that one module, not modules: with
    none of those rules written, the sum would double a whole output. init writes it as a comment. (The plan
    is transformers 5.24's: 5.25 leaves the experts, shared and routed, out of Inkling's tp_plan.)"""
    model = _meta("inkling_text")
    model.config.base_model_tp_plan = {
        "layers.*.mlp.experts.gate_up_proj": "colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.shared_experts.gate_proj": "colwise",
        "layers.*.mlp.shared_experts.up_proj": "colwise",
        "layers.*.mlp.shared_experts.down_proj": "rowwise",
        "layers.*.mlp.shared_experts": "all_reduce",
    }
    text = init_plan(model, tp=2, name="inkling")
    assert "    # model.layers.*.mlp.shared_experts           : all_reduce: it sums a partial output" in text
    assert "    model.layers.*.mlp.experts                  : expert_tensor_parallel\n" in text
