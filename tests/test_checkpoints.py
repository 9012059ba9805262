"""Checkpoints (`--save`, `--load`, `shardlang convert`): saved under one plan and loaded under another
(other tp, other dp, other world size, no sharding at all), every full tensor of the model and of the
optimizer state comes back bit for bit; an interrupted save keeps the previous checkpoint; a checkpoint
that does not fit is refused with the list of what does not fit, and nothing is changed."""

import json

import pytest
import torch
import torch.nn as nn

from shardlang import PlanError
from shardlang.checkpoints.loading import load_checkpoint
from shardlang.checkpoints.reading import read_checkpoint
from shardlang.checkpoints.saving import publish, save_checkpoint
from shardlang.cli import main
from shardlang.launch.workers import WorkerError

from . import checkpoint_jobs as jobs
from .conftest import ROOT
from .test_apply_cli import shardlang_apply

LLAMA_2D = str(ROOT / "plans/llama_2d.sl")
HSDP = str(ROOT / "plans/hsdp.sl")
LLAMA = "examples.llama:build_model"


def assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: names differ: {sorted(got.keys() ^ want.keys())[:5]}"
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[name].dtype == value.dtype and got[name].shape == value.shape, f"{what}: {name}"
            assert torch.equal(got[name].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), (
                f"{what}: {name} differs"
            )
        else:
            assert got[name] == value, f"{what}: {name}"


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory):
    """A checkpoint of the Llama example trained two Adam steps under (dp 2, tp 2) at world 4, and the
    full tensors it was saved from."""
    directory = str(tmp_path_factory.mktemp("checkpoints") / "dp2_tp2")
    states = pools(4).run(jobs.train_and_save, LLAMA_2D, {"tp": 2}, LLAMA, directory)
    assert all(s.keys() == states[0].keys() for s in states)
    return directory, states[0]


@pytest.mark.distributed
def test_a_checkpoint_is_plain_dcp_with_what_wrote_it(saved):
    directory, state = saved
    checkpoint = read_checkpoint(directory)
    assert checkpoint.nested and checkpoint.has_optimizer
    assert checkpoint.info["world_size"] == 4 and checkpoint.info["optimizer"] == "Adam"
    assert set(checkpoint.model) == {k.removeprefix("model.") for k in state if k.startswith("model.")}
    assert checkpoint.bytes == sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world, plan, params",
    [
        (4, LLAMA_2D, {"tp": 1}),  # dp 4
        (4, LLAMA_2D, {"tp": 4}),  # tp 4
        (4, HSDP, {"shard": 2}),  # HSDP 2 x 2
        (2, LLAMA_2D, {"tp": 2}),  # world 2: tp 2
        (2, HSDP, {"shard": 2}),  # world 2: FSDP 2
    ],
    ids=["dp4", "tp4", "hsdp_2x2", "world2_tp2", "world2_fsdp2"],
)
def test_loads_bitwise_under_another_plan_and_world(pools, saved, world, plan, params):
    directory, want = saved
    for rank, got in enumerate(pools(world).run(jobs.load_under, plan, params, LLAMA, directory)):
        assert_bitwise(got, want, f"rank {rank}")


@pytest.mark.distributed
def test_loads_bitwise_into_one_unsharded_process(saved):
    from examples.llama import build_model

    directory, want = saved
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    transfer = load_checkpoint(model, directory, optimizer)
    assert transfer.optimizer and transfer.tensors == len([k for k in want if k.startswith("model.")])
    assert_bitwise(jobs.full_state(model, optimizer), want, "unsharded")


@pytest.mark.distributed
def test_convert_to_a_torch_file_and_back(saved, tmp_path):
    from examples.llama import build_model

    directory, want = saved
    model_only = {k: v for k, v in want.items() if k.startswith("model.")}
    assert main(["convert", directory, str(tmp_path / "model.pt")]) == 0
    plain = torch.load(tmp_path / "model.pt", weights_only=True)
    assert_bitwise({f"model.{k}": v for k, v in plain.items()}, model_only, "model.pt")
    model = build_model()
    model.load_state_dict(plain)  # a plain state dict, as torch.save(model.state_dict()) writes it

    assert main(["convert", directory, str(tmp_path / "both.pt"), "--optimizer"]) == 0
    both = torch.load(tmp_path / "both.pt", weights_only=True)
    assert set(both) == {"model", "optimizer"}

    for source, with_optimizer in (("model.pt", False), ("both.pt", True)):
        back = tmp_path / f"back_{source.removesuffix('.pt')}"
        assert main(["convert", str(tmp_path / source), str(back)]) == 0
        model = build_model()
        optimizer = torch.optim.Adam(model.parameters()) if with_optimizer else None
        load_checkpoint(model, back, optimizer)
        assert_bitwise(jobs.full_state(model, optimizer), want if with_optimizer else model_only, f"from {source}")


@pytest.mark.distributed
def test_a_save_killed_part_way_keeps_the_previous_checkpoint(pools, saved, tmp_path):
    from examples.llama import build_model

    directory, want = saved
    target = tmp_path / "ck"
    before = tmp_path / "before.pt"
    assert main(["convert", directory, str(before), "--optimizer"]) == 0
    assert main(["convert", str(before), str(target)]) == 0
    with pytest.raises(WorkerError):
        pools(2).run(jobs.save_and_die, HSDP, LLAMA, str(target), 1)
    leftovers = list(tmp_path.glob(".ck.saving-*"))
    assert leftovers, "the interrupted save wrote somewhere other than beside the checkpoint"
    assert not (leftovers[0] / ".metadata").exists()
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters())
    load_checkpoint(model, target, optimizer)
    assert_bitwise(jobs.full_state(model, optimizer), want, "after the interrupted save")
    save_checkpoint(model, target)  # the next save that finishes clears what the killed one left
    assert not list(tmp_path.glob(".ck.saving-*"))


def test_publish_swaps_in_one_step_and_without_renameat2(tmp_path, monkeypatch):
    import shardlang.checkpoints.saving as saving

    def checkpoint_dir(name: str, marker: str):
        path = tmp_path / name
        path.mkdir()
        (path / ".metadata").write_text(marker)
        return path

    target = checkpoint_dir("ck", "old")
    publish(checkpoint_dir(".ck.saving-a", "new"), target)
    assert (target / ".metadata").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    monkeypatch.setattr(saving, "_exchange", lambda a, b: False)  # a system without an atomic swap
    publish(checkpoint_dir(".ck.saving-b", "newer"), target)
    assert (target / ".metadata").read_text() == "newer" and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


class Small(nn.Module):
    def __init__(self, hidden=8, bias=True):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, hidden, bias=bias), nn.Linear(hidden, 2)


def test_a_checkpoint_that_does_not_fit_lists_every_misfit_and_changes_nothing(tmp_path):
    save_checkpoint(Small(), tmp_path / "small")
    cases = {
        "shape": (
            Small(hidden=16),
            [
                "fc1.weight: shape (8, 4) in the checkpoint, (16, 4) in the model",
                "fc2.weight: shape (2, 8) in the checkpoint, (2, 16) in the model",
            ],
        ),
        "keys": (Small(bias=False), ["checkpoint key fc1.bias is not in the model"]),
        "dtype": (Small().half(), ["fc1.weight: dtype float32 in the checkpoint, float16 in the model"]),
    }
    for what, (model, expected) in cases.items():
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(PlanError) as caught:
            load_checkpoint(model, tmp_path / "small")
        (d,) = caught.value.diagnostics
        assert d.code == "SL500", what
        for line in expected:
            assert line in d.help, (what, d.help)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), f"{what}: the model changed"


@pytest.mark.distributed
def test_optimizer_state_of_another_class_is_refused_and_the_optimizer_untouched(saved):
    from examples.llama import build_model

    directory, _ = saved
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(PlanError) as caught:
        load_checkpoint(model, directory, optimizer)
    assert "holds Adam state, the optimizer is SGD" in caught.value.diagnostics[0].message
    assert not optimizer.state


def test_paths_that_are_not_checkpoints(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(PlanError) as caught:
        save_checkpoint(Small(), tmp_path / "notes")
    assert caught.value.diagnostics[0].code == "SL501"
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"
    for bad in (tmp_path / "missing", tmp_path / "notes"):
        with pytest.raises(PlanError) as caught:
            read_checkpoint(bad)
        assert caught.value.diagnostics[0].code == "SL501"
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "x.pt")]) == 2
    assert "error[SL501] no such file" in capsys.readouterr().err
    torch.save([1, 2], tmp_path / "list.pt")
    assert main(["convert", str(tmp_path / "list.pt"), str(tmp_path / "out")]) == 2
    assert "error[SL501]" in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.distributed
def test_apply_save_then_load_under_another_world(tmp_path):
    """The commands end to end: train and save at world 4 (dp 2 x tp 2), resume at world 2 (tp 2), where
    the gradients check also resumes the Adam state, in the sharded model and in its reference."""
    target = str(tmp_path / "ck")
    saved = shardlang_apply(
        LLAMA_2D,
        "examples/llama.py",
        "--nproc",
        "4",
        "--verify",
        "gradients",
        "--steps",
        "1",
        "--save",
        target,
        "--json",
    )
    assert saved.returncode == 0, saved.stderr
    report = json.loads(saved.stdout)
    assert report["checkpoint"]["saved"]["optimizer"] and report["checkpoint"]["loaded"] is None
    assert "save" in report["seconds"]

    loaded = shardlang_apply(
        LLAMA_2D, "examples/llama.py", "--nproc", "2", "--verify", "gradients", "--steps", "1", "--load", target
    )
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert f"resumed Adam state from {target}" in loaded.stdout
    assert f"loaded {target}: 21 tensors" in loaded.stdout


@pytest.mark.distributed
def test_apply_refuses_a_checkpoint_that_does_not_fit_before_starting_workers(tmp_path):
    save_checkpoint(Small(), tmp_path / "small")
    done = shardlang_apply("plans/mlp_tp.sl", "examples/mlp.py", "--nproc", "2", "--load", str(tmp_path / "small"))
    assert done.returncode == 2
    assert "error[SL500] the checkpoint at" in done.stderr and "is not in the model" in done.stderr
    assert "starting" not in done.stderr  # refused before any worker started
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    done = shardlang_apply("plans/mlp_tp.sl", "examples/mlp.py", "--nproc", "2", "--save", str(tmp_path / "notes"))
    assert done.returncode == 2 and "error[SL501] cannot save to" in done.stderr


def test_a_wrapped_model_is_keyed_as_the_unwrapped_one_and_loads_by_those_keys():
    """The segments activation checkpointing's wrapper and torch.compile insert into names
    (frontend.patterns.WRAPPER_SEGMENTS, which the gradients check's recording leaves out too) are not in a
    checkpoint's keys, and loading finds the wrapped tensors by the plain keys."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from shardlang.checkpoints.state import load_model_state_dict, model_state_dict

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.Linear(3, 2)))
    wrapped = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 3)), torch.compile(nn.Sequential(nn.Linear(3, 2))))
    assert set(wrapped.state_dict()) != set(plain.state_dict())
    assert list(model_state_dict(wrapped)) == list(plain.state_dict())
    load_model_state_dict(wrapped, plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model_state_dict(wrapped).values(), plain.state_dict().values()))
