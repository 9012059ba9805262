"""Hugging Face transformers models: a model from a config.json alone (`--hf`), `init meta` that keeps
what their constructors compute, and starter plans from their own TP plans. Skipped without the extra
(pip install -e '.[hf]')."""

import importlib.util
import re

import pytest
import torch

from shardlang.compiler.predict import expert_tp_layout
from shardlang.compiler.starter import HF_STYLES, block_stacks, hf_tp_plan, init_plan
from shardlang.runtime.modelfile import ModelFileError, load_model_file

from .conftest import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs pip install -e '.[hf]'")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A directory saved by save_pretrained with only config.json, as a user's checkpoint folder has."""
    from examples.hf_qwen3 import build_model

    folder = tmp_path_factory.mktemp("qwen3")
    with torch.device("meta"):
        build_model().config.save_pretrained(folder)
    return folder


def test_hf_model_file_builds_the_architecture_its_config_names(qwen3_dir):
    import pickle

    for path in (qwen3_dir, qwen3_dir / "config.json"):
        model_file = load_model_file(hf=str(path), seq=16)
        with torch.device("meta"):
            model = model_file.build_model()
        assert type(model).__name__ == "Qwen3ForCausalLM"
        tokens = model_file.example_input(3, torch.Generator().manual_seed(0))
        assert tokens.shape == (3, 16) and int(tokens.max()) < model.config.vocab_size
        again = pickle.loads(pickle.dumps(model_file))  # it crosses to the workers by its path
        assert again.hf == str(path) and again.seq == 16


def test_hf_model_file_without_a_config_is_a_clear_error(tmp_path):
    with pytest.raises(ModelFileError, match="no config.json"):
        load_model_file(hf=str(tmp_path))


def test_starter_plan_translates_the_models_own_tp_plan():
    from examples.hf_qwen3 import build_model

    with torch.device("meta"):
        model = build_model()
    assert block_stacks(model) == ("model.layers",)
    plan = hf_tp_plan(model)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["lm_head"] == "colwise_gather_output"
    text = init_plan(model, tp=2, name="Qwen3")
    assert "model.layers.*.self_attn.q_norm : replicated_with_grad_allreduce" in text
    assert "lm_head                         : colwise_gather_output" in text
    assert "each model.layers.*" in text and "init meta" in text
    assert all(style in HF_STYLES for style in plan.values()), "an HF style the mapping table lacks"


def test_every_transformers_style_has_a_shardlang_style_or_a_reason():
    """Every style transformers registers maps to a style the language accepts, or to a comment saying why
    there is none."""
    import shardlang
    from shardlang.compiler.starter import WHY_NOT

    try:
        from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES
    except ImportError:  # an older transformers
        ALL_PARALLEL_STYLES = HF_STYLES
    assert set(ALL_PARALLEL_STYLES) <= set(HF_STYLES), "an HF style the mapping table lacks"
    for hf, ours in HF_STYLES.items():
        if ours is None:
            assert hf in WHY_NOT, f"{hf}: no style and no reason"
        else:
            style = ours.format(rope=8)  # a template filled from the model's config
            shardlang.loads(f"mesh world = cpu[tp=2]\nparallelize on world.tp {{ a : {style} }}\n")


REVIEWED = re.compile(r"^(\s*\S+\s*:\s*)\S+(\s*)# reviewed: was (\S+)$")
WRITTEN_BY_INIT = re.compile(r"written by `shardlang init (\S+) --tp 2`")
INIT_PLANS = [p for p in sorted((ROOT / "plans" / "hf").glob("*.sl")) if WRITTEN_BY_INIT.search(p.read_text())]


@pytest.mark.parametrize("plan", INIT_PLANS, ids=lambda p: p.stem)
def test_plans_written_by_init_keep_its_rules(plan):
    """A plan in plans/hf/ that `shardlang init` wrote has init's rules today, apart from the lines its
    review changed (`# reviewed: was STYLE`), and init's plan lints clean at tp 2 x dp 2."""
    import shardlang
    from shardlang.runtime.modelfile import load_model_file

    text = plan.read_text()
    written = WRITTEN_BY_INIT.search(text)
    with torch.device("meta"):
        model = load_model_file(str(ROOT / written.group(1))).build_model()
    fresh = init_plan(model, tp=2)
    assert not [d for d in shardlang.loads(fresh).lint(model, world_size=4) if d.is_error]

    def rules(plan_text: str) -> list[str]:
        block = plan_text.split("parallelize on world.tp {", 1)[1].split("}", 1)[0]
        return [REVIEWED.sub(r"\1\3", line).rstrip() for line in block.splitlines() if line.strip()]

    assert rules(text) == rules(fresh)


def test_sl202_help_names_the_style_that_fits_a_transformers_layer():
    import shardlang
    from examples.hf_gpt2 import build_model as gpt2
    from examples.hf_qwen3_moe import build_model as qwen3_moe

    plan = shardlang.loads(
        "mesh world = cpu[tp=2]\nparallelize on world.tp { transformer.h.0.attn.c_attn : colwise }\n"
    )
    with torch.device("meta"):
        (found,) = plan.lint(gpt2(), world_size=2)
    assert "(Conv1D)" in found.message and "use colwise_conv1d or rowwise_conv1d" in found.help[0]
    plan = shardlang.loads("mesh world = cpu[tp=2]\nparallelize on world.tp { model.layers.0.mlp.experts : rowwise }\n")
    with torch.device("meta"):
        (found,) = plan.lint(qwen3_moe(), world_size=2)
    assert "gate_up_proj [4, 64, 64], down_proj [4, 64, 32], fused experts" in found.help[0]
    assert "leave it without a rule" in found.help[0]


def test_starter_plan_of_a_moe_model_splits_the_experts_by_width():
    """transformers' moe_tp_experts is expert_tensor_parallel; the tensor-level rules of its plan, which
    that style covers, stay comments."""
    from examples.hf_qwen3_moe import build_model

    with torch.device("meta"):
        text = init_plan(build_model(), tp=2)
    assert "    model.layers.*.mlp.experts              : expert_tensor_parallel\n" in text
    assert "# model.layers.*.mlp.experts.gate_up_proj : packed_colwise: a parameter, not a module" in text
    assert "# model.layers.*.mlp.gate_proj            : colwise: no such module in this model" in text


def test_experts_the_models_tp_plan_leaves_whole_are_split_by_width():
    """transformers 5.25 leaves every MoE's experts out of its tp_plan (expert parallelism instead): init
    splits them by width all the same, saying so, rather than keep every expert whole on each tp rank; not
    where --ep splits them, nor stored [experts, in, out] (Ergo's, gpt-oss's), which no layout here takes."""
    from examples.hf_qwen3_moe import TP_PLAN, build_model

    with torch.device("meta"):
        model = build_model()
    model.config.base_model_tp_plan = {k: v for k, v in TP_PLAN.items() if ".experts" not in k}
    model._tp_plan = {k: v for k, v in model._tp_plan.items() if ".experts" not in k}
    text = init_plan(model, tp=2)
    assert "    # model.layers.*.mlp.experts: added: the model's tp_plan leaves these experts whole" in text
    assert re.search(r"\n    model\.layers\.\*\.mlp\.experts +: expert_tensor_parallel\n", text), text
    assert "expert_tensor_parallel" not in init_plan(model, tp=2, ep=2)
    experts = model.model.layers[0].mlp.experts
    experts.is_transposed = True
    assert "is_transposed" in expert_tp_layout(experts, 2)
    assert "expert_tensor_parallel" not in init_plan(model, tp=2)


def test_starter_plan_of_a_model_without_tp_plan_is_fsdp_only():
    import shardlang
    from examples.llama import build_model

    with torch.device("meta"):
        model = build_model()
    text = init_plan(model, tp=1, name="llama")
    assert "parallelize" not in text and "each layers.*" in text
    assert not [d for d in shardlang.loads(text).lint(model, world_size=4) if d.is_error]
    assert (ROOT / "examples" / "llama.py").exists()


def _olmo2():
    from transformers import Olmo2Config, Olmo2ForCausalLM

    from examples.hf_llama import SMALL

    return Olmo2ForCausalLM(Olmo2Config(**SMALL, eos_token_id=None, pad_token_id=None))


@pytest.mark.parametrize(
    ("build", "stack"),
    [
        ("examples.hf_stablelm", "model.layers"),  # 4 per-head norms per attention, 2 layers
        ("examples.hf_qwen3", "model.layers"),  # q_norm / k_norm inside attention
        ("examples.hf_gpt2", "transformer.h"),
        ("olmo2", "model.layers"),  # full-width q_norm / k_norm
    ],
)
def test_starter_stack_is_the_decoder_layers_not_norms_inside_them(build, stack):
    """FSDP units go on the stack holding the most parameters, traced or not: StableLM's per-head norms
    (a ModuleList of 4 LayerNorms in each attention, more than its 2 layers) were chosen before."""
    import importlib

    from shardlang.compiler.trace import trace_order

    with torch.device("meta"):
        model = _olmo2() if build == "olmo2" else importlib.import_module(build).build_model()
    from examples.hf_llama import example_input

    order = trace_order(model, example_input)
    assert order.traced, order.why
    assert block_stacks(model) == block_stacks(model, order) == (stack,)
    assert f"    each {stack}.*\n" in init_plan(model, tp=2, order=order)


def test_starter_plan_without_a_tp_plan_has_no_tp_dim():
    """--tp 3 for a model without a TP plan of its own, where no rule proposed from its structure splits
    evenly (4 heads, MLP width 128, vocabulary 128): the tp dim would be used by nothing (its ranks train
    on different data and never average, SL217), so the plan has none and says why."""
    import shardlang
    from examples.hf_stablelm import build_model

    with torch.device("meta"):
        model = build_model()
    assert hf_tp_plan(model) == {}
    text = init_plan(model, tp=3)
    assert "mesh world = auto[dp=auto]\n" in text and "parallelize" not in text.replace("`parallelize", "")
    assert "no tp_plan of its own" in text and "SL217" in text
    assert not shardlang.loads(text).lint(model, world_size=4)
    # the plan it wrote before: a tp dim nothing uses, now an error
    found = shardlang.loads(text.replace("auto[dp=auto]", "auto[dp=auto, tp=3]")).lint(model, world_size=6)
    assert [d.code for d in found] == ["SL217"] and "world.tp" in found[0].message


@pytest.mark.distributed
def test_init_applies_the_plan_it_writes(tmp_path, capsys, monkeypatch):
    """init runs its plan's checks on CPU workers before it calls the plan clean: StableLM (no TP plan,
    per-head norms) at --tp 2, whose plan once kept an unused tp dim and FSDP units on layer 0's norms,
    and failed its own gradients check; its rules are now proposed from its structure (the attention,
    holding a norm per head, stays whole)."""
    from shardlang.cli.main import main

    monkeypatch.chdir(ROOT)
    plan = tmp_path / "stablelm.sl"
    assert main(["init", "examples/hf_stablelm.py", "--tp", "2", "-o", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "linted clean and applied at world 4 on CPU: 5 passed, 1 reported" in out, out
    assert "each model.layers.*\n" in plan.read_text()
    assert "    model.layers.*.mlp.down_proj           : rowwise\n" in plan.read_text()


@pytest.mark.distributed  # init lints with the simulated step, in a forked child
def test_init_says_what_it_did_not_check(tmp_path, capsys, monkeypatch):
    from shardlang.cli.main import main

    monkeypatch.chdir(ROOT)
    plan = tmp_path / "qwen3.sl"
    assert main(["init", "examples/hf_qwen3.py", "--tp", "2", "--no-check", "-o", str(plan)]) == 0
    assert "linted at world 4: clean; not applied (--no-check)" in capsys.readouterr().out
    source = tmp_path / "no_input.py"
    source.write_text("from examples.hf_qwen3 import build_model  # noqa: F401\n")
    monkeypatch.syspath_prepend(str(ROOT))
    assert main(["init", str(source)]) == 0
    err = capsys.readouterr().err
    assert "not applied:" in err and "defines no example_input" in err


@pytest.mark.distributed
def test_init_and_lint_and_apply_with_hf(qwen3_dir, tmp_path, capsys, monkeypatch, pools):
    """The three commands a user runs: init a plan from the config, lint it, apply it (on the pool)."""
    import shardlang
    from shardlang.cli.main import main
    from shardlang.launch.job import Job, run
    from shardlang.runtime.modelfile import load_model_file

    monkeypatch.chdir(ROOT)
    plan = tmp_path / "qwen3.sl"
    assert main(["init", "--hf", str(qwen3_dir), "--tp", "2", "--no-check", "-o", str(plan)]) == 0
    assert "linted at world 4: clean" in capsys.readouterr().out
    assert main(["lint", str(plan), "--hf", str(qwen3_dir), "--world", "4"]) == 0
    model_file = load_model_file(hf=str(qwen3_dir), seq=16)
    checks = shardlang.load(plan).checks
    report = pools(4).run(run, Job(str(plan), {}, None, None, checks, model_file=model_file, explicit=True))[0]
    assert report.ok, [(c.check, c.status, c.message) for c in report.checks]
    assert all(c.status == "pass" or (c.check, c.status) == ("comms", "reported") for c in report.checks)


def test_hf_without_config_is_a_usage_error(tmp_path, capsys):
    from shardlang.cli.main import main

    assert main(["lint", "plans/hf/qwen3.sl", "--hf", str(tmp_path), "--world", "2"]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.distributed
def test_moe_with_transformers_default_experts_passes_and_a_dropped_reduction_fails(tmp_path, pools):
    """Qwen3-MoE runs its experts by torch._grouped_mm, which has no float64 kernel: the float64 truth
    replaces it, the reviewed plan passes, and the same plan without the all-reduce of the q/k norms'
    gradients (their rules dropped: each tp rank's norm sees only its own heads) fails at the norm."""
    import shardlang
    from examples.hf_qwen3_moe import build_model
    from shardlang.launch.job import Job, run

    with torch.device("meta"):
        assert build_model().config._experts_implementation == "grouped_mm"
    plan = (ROOT / "plans" / "hf" / "qwen3_moe.sl").read_text()
    dropped = re.sub(r"\n\s*model\.layers\.\*\.self_attn\.[qk]_norm\s*:.*", "", plan)
    assert dropped.count("\n") == plan.count("\n") - 2
    reports = {}
    for name, text in (("fixed", plan), ("dropped", dropped)):
        path = tmp_path / f"{name}.sl"
        path.write_text(text.replace("init meta", "init meta\nverify gradients(steps=1)"))
        job = Job(str(path), {}, str(ROOT / "examples" / "hf_qwen3_moe.py"), None, shardlang.load(path).checks)
        (reports[name],) = pools(4).run(run, job)[0].checks
    assert reports["fixed"].status == "pass", reports["fixed"].message
    assert reports["fixed"].data["truth"] == "float64 (torch._grouped_mm by float64 matmuls)"
    assert reports["dropped"].status == "fail", reports["dropped"].message
    assert "self_attn.q_norm.weight" in reports["dropped"].message


def test_init_writes_expert_parallelism_from_the_models_ep_plan():
    """--ep: transformers' ep_plan (`ep_dispatch_experts` on the experts module) becomes expert_parallel on an
    ep dim that borrows data-parallel ranks; the tp rules inside the experts stay comments."""
    from examples.hf_qwen3_moe import build_model

    with torch.device("meta"):
        model = build_model()
    text = init_plan(model, tp=2, ep=2)
    assert "mesh world = auto[dp=auto, ep=2, tp=2]" in text
    assert re.search(r"\n    model\.layers\.\*\.mlp\.experts +: expert_parallel\n", text), text
    assert re.search(r"# model\.layers\.\*\.mlp\.experts +: moe_tp_experts: the experts are split over ep", text)
    assert "fully_shard on world[dp*ep] {" in text
    plain = init_plan(model, ep=2)
    assert "mesh world = auto[dp=auto, ep=2]" in plain and "parallelize on world.tp" not in plain
    # a model without an ep_plan keeps no ep dim, and says why
    from examples.hf_qwen3 import build_model as dense

    with torch.device("meta"):
        text = init_plan(dense(), ep=2)
    assert "mesh world = auto[dp=auto]" in text and "--ep 2 asked for, but the model carries no ep_plan" in text


@pytest.mark.distributed
def test_init_applies_the_expert_parallel_plan_it_writes(tmp_path, capsys, monkeypatch):
    from shardlang.cli.main import main

    monkeypatch.chdir(ROOT)
    plan = tmp_path / "moe.sl"
    assert main(["init", "examples/hf_qwen3_moe.py", "--ep", "2", "-o", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "linted clean and applied at world 4 on CPU: 5 passed, 1 reported" in out, out


def test_init_writes_mla_with_the_models_rotary_width():
    """DeepSeek-V2's tp_plan says `mla_kv_a_proj` on kv_a_proj_with_mqa: init writes the built-in style with
    rope= the config's qk_rope_head_dim, and lint checks it against the module."""
    import shardlang
    from examples.field.deepseek_v2 import build_model

    with torch.device("meta"):
        model = build_model()
    text = init_plan(model, tp=2)
    assert re.search(r"\n    model\.layers\.\*\.self_attn\.kv_a_proj_with_mqa +: mla_kv_a_proj\(rope=8\)\n", text), text
    assert not [d for d in shardlang.loads(text).lint(model, world_size=4) if d.is_error]
    bad = text.replace("mla_kv_a_proj(rope=8)", "mla_kv_a_proj(rope=40)")
    found = [d for d in shardlang.loads(bad).lint(model, world_size=4) if d.code == "SL202"]
    assert found and "rope=40 leaves no latent of its 40 outputs" in found[0].help[0] + found[0].message
    with pytest.raises(shardlang.PlanError, match="mla_kv_a_proj needs rope=N"):
        shardlang.loads(text.replace("mla_kv_a_proj(rope=8)", "mla_kv_a_proj"))


def test_init_writes_the_context_parallel_plan_of_a_transformers_decoder():
    """`init --cp 2` on transformers' Llama writes plans/hf/llama_cp.sl's statements; a model whose
    attention is not SDPA gets no cp dim, and a comment saying why."""
    from transformers import LlamaForCausalLM

    from examples.hf_llama import config

    with torch.device("meta"):
        model = LlamaForCausalLM(config())
    statements = [line for line in init_plan(model, cp=2).splitlines() if line and not line.startswith("#")]
    shipped = (ROOT / "plans" / "hf" / "llama_cp.sl").read_text().splitlines()
    assert statements == [line for line in shipped if line and not line.startswith("#")]
    eager = config()
    eager._attn_implementation = "eager"
    with torch.device("meta"):
        text = init_plan(LlamaForCausalLM(eager), cp=2)
    assert "cp=" not in text and "its attention runs 'eager'" in text
