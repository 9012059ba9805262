"""Hugging Face weights (`apply --hf DIR --load DIR`, `--save-format hf`): each rank reads only the blocks
its shards hold, and every tensor comes out bitwise equal to `from_pretrained` in one process; weights
that do not fit are SL500 listing every misfit before any worker starts; what `--save-format hf` writes
`from_pretrained` reads. Skipped without the extra (pip install -e '.[hf]')."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from shardlang import PlanError
from shardlang.cli import main

from . import hf_weight_jobs as jobs
from .conftest import ROOT
from .test_apply_cli import shardlang_apply

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs pip install -e '.[hf]'")

QWEN3_TP = str(ROOT / "plans/hf/qwen3_tp.sl")  # TP (embedding rowwise, lm_head colwise) + FSDP, init meta
LLAMA = str(ROOT / "plans/hf/llama.sl")  # TP on the blocks + FSDP, init cpu


def from_pretrained(directory) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).state_dict()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """Qwen3 saved by save_pretrained (one model.safetensors, float32), its vocabulary of 130 uneven over
    tp 2 x dp 2: FSDP's chunks of TP's shards are 33 and 32 rows."""
    from transformers import Qwen3ForCausalLM

    from examples.hf_qwen3 import build_model

    with torch.device("meta"):
        config = build_model().config
    config.vocab_size = 130
    torch.manual_seed(1)
    folder = tmp_path_factory.mktemp("qwen3")
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """Llama with tied embeddings in bfloat16, its keys without the `model.` prefix (a base model's
    checkpoint) in three files and their index, as older checkpoints are."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from examples.hf_llama import config

    settings = config()
    settings.tie_word_embeddings = True
    torch.manual_seed(2)
    model = LlamaForCausalLM(settings)
    folder = tmp_path_factory.mktemp("llama")
    state = {k.removeprefix("model."): v.bfloat16() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    names, weight_map = list(state), {}
    for i in range(3):
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({k: state[k] for k in names[i::3]}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names[i::3], file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model.config.save_pretrained(folder)
    return folder


@pytest.mark.distributed
def test_each_rank_reads_its_blocks_and_every_tensor_equals_from_pretrained(pools, qwen3_dir, llama_dir, tmp_path):
    """World 4 (dp 2 x tp 2): load, compare, count the reads, save as HF weights; then `apply --load`."""
    cases = [
        (QWEN3_TP, str(qwen3_dir), str(tmp_path / "qwen3"), 50 * 10**9),  # one model.safetensors
        (LLAMA, str(llama_dir), str(tmp_path / "llama"), 100_000),  # several files and their index
    ]
    done = pools(4).run(jobs.load_cases_then_apply, cases, QWEN3_TP, str(qwen3_dir))
    for (plan, directory, saved, _), *per_rank in zip(cases, *(d["loaded"] for d in done)):
        want = from_pretrained(directory)
        stored = _headers(Path(directory))
        for rank, got in enumerate(per_rank):
            what = f"{plan} rank {rank}"
            assert got["full"].keys() == want.keys(), what
            for key, value in want.items():
                assert torch.equal(got["full"][key], value), f"{what}: {key} differs from from_pretrained"
            # Every stored tensor read once, as exactly this rank's block: no rank reads a whole sharded tensor.
            assert got["reads"].keys() == stored.keys(), what
            for name, blocks in got["reads"].items():
                key = name if name in got["local"] else f"model.{name}"
                assert [shape for shape, _ in blocks] == [got["local"][key]], f"{what}: {name}"
            read = sum(b for blocks in got["reads"].values() for _, b in blocks)
            assert read < sum(stored.values()) * 0.6, f"{what}: read {read} of {sum(stored.values())} bytes"
            assert got["tensors"] == len(stored) and len(got["sharded"]) > 10, what
        # What --save-format hf wrote from the sharded model, from_pretrained reads back bitwise.
        back = from_pretrained(saved)
        assert back.keys() == want.keys() and all(torch.equal(back[k], v) for k, v in want.items()), saved
    assert sorted(p.name for p in (tmp_path / "qwen3").iterdir()) == ["config.json", "model.safetensors"]
    llama_files = sorted(p.name for p in (tmp_path / "llama").iterdir())
    assert "model.safetensors.index.json" in llama_files and "model-00002-of-00004.safetensors" in llama_files
    assert all(d["loaded"][1]["tied"] for d in done), "lm_head no longer tied to the embedding"
    report = done[0]["report"]
    init, gradients = report.checks
    assert init.status == "skipped" and f"loaded from {qwen3_dir}" in init.message
    # The unsharded reference starts from the loaded weights: a step on both agrees.
    assert gradients.status == "pass", gradients.message
    assert report.checkpoints["loaded"].tensors == len(_headers(qwen3_dir))


def _headers(directory) -> dict:
    """Checkpoint name -> stored bytes, from safetensors itself."""
    from safetensors import safe_open

    sizes = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                block = f.get_slice(name)
                shape = block.get_shape()
                sizes[name] = torch.Size(shape).numel() * (2 if block.get_dtype() == "BF16" else 4)
    return sizes


@pytest.mark.distributed
def test_the_command_loads_and_saves_hf_weights_that_from_pretrained_reads(qwen3_dir, tmp_path):
    out = tmp_path / "saved"
    done = shardlang_apply(
        QWEN3_TP,
        "--hf",
        str(qwen3_dir),
        "--load",
        str(qwen3_dir),
        "--nproc",
        "2",
        "--verify",
        "module_states",
        "--save",
        str(out),
        "--save-format",
        "hf",
        "--json",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["checkpoint"]["loaded"]["path"] == str(qwen3_dir) and report["checkpoint"]["saved"]["tensors"] == 25
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    want, got = from_pretrained(qwen3_dir), from_pretrained(out)
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


@pytest.fixture
def misfit_dir(qwen3_dir, tmp_path):
    """qwen3_dir with one tensor missing, one unknown and one of another shape."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "misfit"
    shutil.copytree(qwen3_dir, folder)
    state = load_file(str(folder / "model.safetensors"))
    del state["model.norm.weight"]
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:, :-1].clone()
    state["model.layers.0.mlp.extra.bias"] = torch.zeros(3)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_weights_that_do_not_fit_are_sl500_listing_each_before_any_worker(misfit_dir, capsys, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardlang.checkpoints.hf import load_hf_weights

    monkeypatch.chdir(ROOT)
    status = main(["apply", QWEN3_TP, "--hf", str(misfit_dir), "--load", str(misfit_dir), "--nproc", "2"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"error[SL500] the Hugging Face weights at {misfit_dir} do not fit the model: 3 mismatches" in err
    for line in (
        "model key model.norm.weight is not in the checkpoint",
        "checkpoint key model.layers.0.mlp.extra.bias is not in the model",
        "model.layers.0.mlp.up_proj.weight: shape (128, 63) in the checkpoint, (128, 64) in the model",
    ):
        assert line in err
    assert "starting" not in err  # refused before any worker started
    # Where it is called on a model (every rank does, again): the model is left as it was.
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(misfit_dir)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PlanError) as caught:
        load_hf_weights(model, misfit_dir)
    assert caught.value.diagnostics[0].code == "SL500"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_keys_transformers_would_convert_are_reported_not_guessed():
    from transformers import MixtralConfig, MixtralForCausalLM

    from shardlang.checkpoints.hf import HFWeights, Stored, check_hf_fits

    config = MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=2,
    )  # fmt: skip
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    old_name = "model.layers.0.block_sparse_moe.experts.0.w1.weight"  # fused into experts.gate_up_proj by transformers
    weights = {k: Stored("model.safetensors", v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()}
    weights[old_name] = Stored("model.safetensors", torch.float32, (32, 16))
    del weights["model.layers.0.mlp.experts.gate_up_proj"]
    with pytest.raises(PlanError) as caught:
        check_hf_fits(HFWeights(Path("mixtral"), weights), model)
    (d,) = caught.value.diagnostics
    assert d.help[:2] == (
        "model key model.layers.0.mlp.experts.gate_up_proj is not in the checkpoint",
        f"checkpoint key {old_name} is not in the model",
    )
    assert "transformers renames or fuses mixtral checkpoint keys" in d.help[2]


def test_damaged_weights_and_unsafe_save_targets_are_sl501(qwen3_dir, tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.chdir(ROOT)
    cases = {}
    truncated = tmp_path / "truncated"
    shutil.copytree(qwen3_dir, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated"] = (["--load", str(truncated)], "model.safetensors is truncated or altered")
    indexed = tmp_path / "indexed"
    shutil.copytree(qwen3_dir, indexed)
    (indexed / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "gone.safetensors"}})
    )
    cases["index"] = (["--load", str(indexed)], "gone.safetensors is missing")
    tokenizer = tmp_path / "with_tokenizer"
    shutil.copytree(qwen3_dir, tokenizer)
    (tokenizer / "tokenizer.json").write_text("{}")
    cases["save"] = (
        ["--save", str(tokenizer), "--save-format", "hf"],
        "holds files that are not Hugging Face weights (tokenizer.json)",
    )
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    cases["bin"] = (["--load", str(pickled)], "holds pickled PyTorch weights (pytorch_model*.bin)")
    for what, (flags, expected) in cases.items():
        status = main(["apply", QWEN3_TP, "--hf", str(qwen3_dir), "--nproc", "2", *flags])
        err = capsys.readouterr().err
        assert status == 2 and "error[SL501]" in err and expected in err, (what, err)
    assert (tokenizer / "tokenizer.json").read_text() == "{}"
    assert main(["apply", QWEN3_TP, "--hf", str(qwen3_dir), "--nproc", "2", "--save-format", "hf"]) == 2
    assert "--save-format hf says how --save writes: give --save DIR too" in capsys.readouterr().err
