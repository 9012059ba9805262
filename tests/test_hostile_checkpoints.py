"""Hostile and damaged checkpoints (issue 13): reading one never runs code of its own, a damaged one is
one SL501 naming the file with exit status 2 and no traceback, and saving follows a symlinked directory
and takes a lock, so two saves to one directory never remove each other's work.

Commands run as `python -m shardlang` where a whole process matters (the pickle payload, the workers of
`apply`); the rest in this process through `main` and the library, which is the same code and cheaper."""

import io
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardlang import PlanError
from shardlang.checkpoints.converting import convert_checkpoint
from shardlang.checkpoints.loading import load_checkpoint
from shardlang.checkpoints.reading import read_checkpoint, read_metadata
from shardlang.checkpoints.records import Checkpoint
from shardlang.checkpoints.saving import save_checkpoint
from shardlang.cli import main

from .conftest import ROOT, shardlang_cli

MLP, MLP_TP = str(ROOT / "examples/mlp.py"), str(ROOT / "plans/mlp_tp.sl")


class Payload:
    """What an attacker pickles: unpickling it runs `touch MARKER`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


shardlang = shardlang_cli


def refused(rc: int, output: str, *names) -> None:
    """Exit status 2, one SL501 naming each of `names`, no traceback."""
    assert rc == 2, output
    assert output.count("error[SL501]") == 1, output
    assert "Traceback" not in output, output
    line = next(line for line in output.splitlines() if "error[SL501]" in line)
    for name in names:
        assert str(name) in line, output


def refused_here(capsys, argv, *names) -> None:
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    refused(rc, out.out + out.err, *names)


def build():
    from examples.mlp import build_model

    torch.manual_seed(0)
    return build_model()


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A checkpoint of examples/mlp.py with SGD momentum state: tensors, and objects stored as bytes
    (the param_groups' hyperparameters)."""
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    path = tmp_path_factory.mktemp("good") / "ck"
    save_checkpoint(model, path, optimizer)
    return path


@pytest.fixture
def copy(good, tmp_path):
    def make(name="ck"):
        target = tmp_path / name
        target.mkdir()
        for file in good.iterdir():
            (target / file.name).write_bytes(file.read_bytes())
        return target

    return make


# --- 1. no code execution ---------------------------------------------------------------------------


@pytest.mark.distributed
def test_a_metadata_pickle_that_runs_a_command_is_refused_everywhere(copy, tmp_path, capsys):
    evil, marker = copy(), tmp_path / "pwned"
    (evil / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with open(evil / ".metadata", "rb") as f:  # the payload is live: plain pickle, as DCP reads it, runs it
        pickle.load(f)
    assert marker.exists()
    marker.unlink()

    done = shardlang("convert", evil, tmp_path / "out.pt")
    refused(done.returncode, done.stdout + done.stderr, "posix.system", evil / ".metadata")
    # apply --load: the launcher's pre-check, before any worker starts
    refused_here(capsys, ["apply", MLP_TP, MLP, "--nproc", 2, "--verify", "none", "--load", evil], "posix.system")
    for read in (
        lambda: read_checkpoint(evil),
        lambda: load_checkpoint(build(), evil),
        lambda: convert_checkpoint(evil, tmp_path / "out.pt"),
    ):
        with pytest.raises(PlanError, match=r"SL501|refusing to unpickle posix\.system"):
            read()
    assert not marker.exists()


@pytest.mark.distributed
def test_dcp_never_unpickles_metadata_itself(copy, tmp_path):
    """A load hands DCP the metadata read_checkpoint read safely: a .metadata swapped for a payload after
    that (or while the load runs) is never opened by DCP's plain pickle.load."""
    path, marker = copy(), tmp_path / "pwned"
    checkpoint = read_checkpoint(path)
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    model = build()
    load_checkpoint(model, checkpoint, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert not marker.exists()


def test_a_metadata_pickle_that_changes_an_admitted_class_is_refused_and_undone(copy):
    from torch.distributed.checkpoint.metadata import Metadata

    path = copy()
    # GLOBAL Metadata; BUILD (None, {"pwned": 1}): pickle sets class attributes this way
    (path / ".metadata").write_bytes(b"ctorch.distributed.checkpoint.metadata\nMetadata\n(N(dS'pwned'\nI1\nstb.")
    with pytest.raises(PlanError, match="it sets attributes of torch.distributed.checkpoint.metadata.Metadata"):
        read_checkpoint(path)
    assert not hasattr(Metadata, "pwned")


def test_the_allow_list_admits_every_metadata_this_project_writes(good, tmp_path):
    """What save_checkpoint, convert and a hand-written dcp.save write (the metadata the allow-list was
    derived from: tests/test_checkpoints.py covers TP, FSDP and HSDP saves) reads back."""
    dcp.save(
        {"w": torch.zeros(2, dtype=torch.bfloat16), "obj": {"s": "x", "n": [1, 2.0, None]}},
        checkpoint_id=str(tmp_path / "raw"),
        no_dist=True,
    )
    torch.save(
        {k: torch.zeros(2, dtype=d) for k, d in (("a", torch.float16), ("b", torch.int64), ("c", torch.bool))},
        tmp_path / "x.pt",
    )
    convert_checkpoint(tmp_path / "x.pt", tmp_path / "converted")
    for path in (good, tmp_path / "raw", tmp_path / "converted"):
        assert read_metadata(path / ".metadata").state_dict_metadata


def poisoned(path, key, data: bytes) -> None:
    """Point the stored item `key` of the checkpoint at `path` to `data`, appended to its data file."""
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file: plain pickle is fine here
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    file = path / info.relative_path
    info.offset, info.length = file.stat().st_size, len(data)
    with open(file, "ab") as f:
        f.write(data)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return file


@pytest.mark.distributed
@pytest.mark.parametrize("key", ["optimizer.param_groups.0.lr", "model.net1.weight"], ids=["object", "tensor"])
def test_data_files_are_read_without_unpickling_arbitrary_objects(copy, tmp_path, key):
    """Tensors: DCP reads them with torch.load(weights_only=True). Objects stored as bytes: DCP's planner
    reads them with weights_only=False, so shardlang's reads them weights-only first."""
    path, marker = copy(), tmp_path / "pwned"
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    file = poisoned(path, key, payload.getvalue())
    model = build()
    for read in (
        lambda: convert_checkpoint(path, tmp_path / "out.pt", optimizer=True),
        lambda: load_checkpoint(model, path, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)),
    ):
        with pytest.raises(PlanError, match="SL501") as e:
            read()
        assert f"refusing to unpickle posix.system from {file}" in str(e.value)
    assert not marker.exists()


# --- 2. damaged checkpoints -------------------------------------------------------------------------


def damage(path, how: str):
    file = sorted(path.glob("*.distcp"))[0]
    if how == "truncated":
        file.write_bytes(file.read_bytes()[:100])
    elif how == "deleted":
        file.unlink()
    else:  # garbage of the same length
        file.write_bytes(bytes(range(256)) * (file.stat().st_size // 256) + b"x" * (file.stat().st_size % 256))
    return file


@pytest.mark.parametrize("how", ["truncated", "deleted", "garbage"])
def test_a_damaged_data_file_is_sl501_naming_it(copy, tmp_path, capsys, how):
    path = copy()
    file = damage(path, how)
    refused_here(capsys, ["convert", path, tmp_path / "out.pt"], file)
    refused_here(capsys, ["convert", path, tmp_path / "out.pt", "--optimizer"], file)
    with pytest.raises(PlanError, match=str(file)):
        load_checkpoint(build(), path)
    if how != "garbage":  # found from the metadata alone, before `apply` starts a worker
        refused_here(capsys, ["apply", MLP_TP, MLP, "--nproc", 2, "--verify", "none", "--load", path], file)
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.distributed
def test_a_garbage_data_file_is_one_sl501_from_convert_and_from_apply_load(copy, tmp_path):
    path = copy()
    file = damage(path, "garbage")
    done = shardlang("convert", path, tmp_path / "out.pt")
    refused(done.returncode, done.stdout + done.stderr, file)
    # read by the workers, both ranks reading the damaged file
    done = shardlang("apply", MLP_TP, MLP, "--nproc", 2, "--verify", "none", "--load", path)
    refused(done.returncode, done.stdout + done.stderr, file)


@pytest.mark.parametrize(
    "text, says",
    [
        ("[1, 2]", "holds a list, not a JSON object"),
        ('"ck"', "holds a string, not a JSON object"),
        ("3", "holds a number, not a JSON object"),
        ("{", "is not valid JSON"),
        ('{"optimizer": ["SGD"]}', "'optimizer' is a list, not a string"),
    ],
    ids=["list", "string", "number", "invalid", "optimizer-list"],
)
def test_a_shardlang_json_that_is_not_an_object_is_sl501(copy, tmp_path, capsys, text, says):
    path = copy()
    (path / "shardlang.json").write_text(text)
    with pytest.raises(PlanError, match="SL501") as e:
        read_checkpoint(path)
    assert f"{path / 'shardlang.json'}" in str(e.value) and says in str(e.value)
    refused_here(capsys, ["convert", path, tmp_path / "out.pt"], path / "shardlang.json")
    if text == "[1, 2]":  # apply's fit check reads it before any worker starts
        refused_here(capsys, ["apply", MLP_TP, MLP, "--nproc", 2, "--load", path], path / "shardlang.json")


def test_checkpoint_info_is_always_a_dict(good, tmp_path):
    assert read_checkpoint(good).info["optimizer"] == "SGD"
    (tmp_path / "other").mkdir()
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "other"), no_dist=True)
    assert read_checkpoint(tmp_path / "other").info == {}  # written by other code: no shardlang.json
    with pytest.raises(TypeError):
        Checkpoint(good, {}, {}, True, ["not", "a", "dict"])


# --- 3. saving --------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_apply_save_onto_a_symlinked_checkpoint_writes_where_it_points(copy, tmp_path):
    real = copy("real")
    (tmp_path / "link").symlink_to(real)
    done = shardlang("apply", MLP_TP, MLP, "--nproc", 2, "--verify", "none", "--save", tmp_path / "link")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert (tmp_path / "link").is_symlink() and (tmp_path / "link").resolve() == real
    assert read_checkpoint(real).info["plan"] == MLP_TP and read_checkpoint(tmp_path / "link").info["world_size"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no staging, no lock left


def test_symlinks_that_lead_nowhere_or_in_circles_and_a_planted_lock(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "made")
    save_checkpoint(build(), tmp_path / "dangling")  # as writing into it would: the target is created
    assert (tmp_path / "dangling").is_symlink() and read_checkpoint(tmp_path / "made").tensors == 4
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(PlanError, match=f"SL501.*cannot save to {tmp_path / 'a'}"):
        save_checkpoint(build(), tmp_path / "a")
    (tmp_path / "victim").write_text("kept")
    (tmp_path / ".ck.lock").symlink_to(tmp_path / "victim")  # a lock planted as a link is not followed
    with pytest.raises(PlanError, match="SL501.*cannot create its lock"):
        save_checkpoint(build(), tmp_path / "ck")
    assert (tmp_path / "victim").read_text() == "kept" and not (tmp_path / "ck").exists()


HOLD = """
import sys, time
from pathlib import Path
from shardlang.checkpoints.saving import _save_lock
target = Path(sys.argv[1])
with _save_lock(target):
    staging = target.parent / f".{target.name}.saving-theirs"
    staging.mkdir()
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.mark.distributed
def test_a_second_save_to_a_directory_being_saved_is_refused_naming_the_holder(copy, tmp_path, capsys):
    path = copy()
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        refused_here(capsys, ["apply", MLP_TP, MLP, "--nproc", 2, "--save", path], f"pid {holder.pid}", path)
        with pytest.raises(PlanError, match=f"another save to it is running \\(pid {holder.pid} "):
            save_checkpoint(build(), path)
        torch.save(build().state_dict(), tmp_path / "m.pt")
        refused_here(capsys, ["convert", tmp_path / "m.pt", path], f"pid {holder.pid}")
        assert (tmp_path / ".ck.saving-theirs").is_dir()  # its staging directory is its own
        assert {f.name: f.read_bytes() for f in path.iterdir()} == before
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    # killed while holding it: the lock file stays, the kernel's lock does not, and the next save takes it
    assert (tmp_path / ".ck.lock").exists()
    save_checkpoint(build(), path)
    assert not (tmp_path / ".ck.lock").exists()
    assert not (tmp_path / ".ck.saving-theirs").exists()  # a leftover now: the save that finished cleared it


def test_a_failed_save_leaves_the_previous_checkpoint_untouched(copy, tmp_path, monkeypatch):
    path = copy()
    before = {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in path.iterdir()}

    def disk_full(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", disk_full)
    started = time.time()
    with pytest.raises(PlanError, match="SL501.*No space left on device") as e:
        save_checkpoint(build(), path)
    assert "the previous checkpoint" in str(e.value) and "is untouched" in str(e.value)
    assert {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"], "a staging directory or the lock was left"
    assert time.time() - started < 120  # the failure is reported, not retried or waited out


def test_mutated_checkpoints_are_read_or_refused_never_crash(copy, tmp_path):
    """A seeded byte-level fuzz of `.metadata` and of a data file through convert: it converts, or
    raises PlanError(SL501); nothing else escapes."""
    import random

    path = copy()
    files = {f: f.read_bytes() for f in (path / ".metadata", *sorted(path.glob("*.distcp")))}
    rng, outcomes = random.Random(13), set()
    for _ in range(200):
        for f, data in files.items():
            f.write_bytes(data)
        f = rng.choice(list(files))
        data = bytearray(files[f])
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data))
            if rng.random() < 0.7:
                data[at] = rng.randrange(256)
            else:
                del data[at : at + rng.randint(1, 16)]
        f.write_bytes(bytes(data))
        try:
            convert_checkpoint(path, tmp_path / "out.pt", optimizer=True)
            outcomes.add("read")
        except PlanError as e:
            assert [d.code for d in e.diagnostics] == ["SL501"]
            outcomes.add("SL501")
    assert outcomes == {"read", "SL501"}
