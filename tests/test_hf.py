"""Hugging Face transformers models: a model from a config.json alone (`--hf`), `init meta` that keeps
what their constructors compute, and starter plans from their own TP plans. Skipped without the extra
(pip install -e '.[hf]')."""

import importlib.util

import pytest
import torch

from shardlang.compiler.starter import HF_STYLES, hf_tp_plan, init_plan, longest_stack
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
    assert longest_stack(model) == "model.layers"
    plan = hf_tp_plan(model)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["lm_head"] == "colwise_gather_output"
    text = init_plan(model, tp=2, name="Qwen3")
    assert "model.layers.*.self_attn.q_norm : distribute(input=shard(2), output=local)" in text
    assert "each model.layers.*" in text and "init meta" in text
    assert all(style in HF_STYLES for style in plan.values()), "an HF style the mapping table lacks"


def test_starter_plan_of_a_model_without_tp_plan_is_fsdp_only():
    import shardlang
    from examples.llama import build_model

    with torch.device("meta"):
        model = build_model()
    text = init_plan(model, tp=1, name="llama")
    assert "parallelize" not in text and "each layers.*" in text
    assert not [d for d in shardlang.loads(text).lint(model, world_size=4) if d.is_error]
    assert (ROOT / "examples" / "llama.py").exists()


def test_init_and_lint_and_apply_with_hf(qwen3_dir, tmp_path, capsys, monkeypatch, pools):
    """The three commands a user runs: init a plan from the config, lint it, apply it (on the pool)."""
    import shardlang
    from shardlang.cli.main import main
    from shardlang.launch.job import Job, run
    from shardlang.runtime.modelfile import load_model_file

    monkeypatch.chdir(ROOT)
    plan = tmp_path / "qwen3.sl"
    assert main(["init", "--hf", str(qwen3_dir), "--tp", "2", "-o", str(plan)]) == 0
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
