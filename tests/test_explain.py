"""explain: what it predicts for every rank equals what a real gloo run of the same plan holds and
sends; the 80-layer model explains at a simulated world of 1024 without real memory; the pictures."""

import re
import resource
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

import shardlang
from shardlang.explain.simulate import explain
from shardlang.runtime.modelfile import load_model_file

from . import dist_jobs
from .conftest import FIXTURES, ROOT

CASES = [
    ("plans/llama_2d.sl", "examples/llama.py"),  # TP + SP + FSDP + checkpointing + bf16 + init meta
    ("plans/hsdp.sl", "examples/llama.py"),  # HSDP
    ("plans/seeds/fully_shard_uneven.sl", "examples/seeds/uneven.py"),  # uneven and empty shards
    ("tests/fixtures/explain/uneven_tp_fsdp.sl", "examples/seeds/uneven.py"),  # FSDP over uneven TP shards
]


def model_of(plan: str) -> str:
    return re.search(r"Model: (\S+\.py)", (ROOT / plan).read_text()).group(1)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("plan", "model"), CASES, ids=[p.rsplit("/", 1)[-1] for p, _ in CASES])
def test_explain_equals_a_real_run(pools, plan, model, world):
    loaded = shardlang.load(ROOT / plan)
    if loaded.with_world(world):
        pytest.skip(f"{plan} does not fit a world of {world}")
    real = pools(world).run(dist_jobs.local_facts, str(ROOT / plan), str(ROOT / model))
    model_file = load_model_file(str(ROOT / model))
    meta = model_file.build_on_meta()
    for rank in range(world):
        predicted = explain(loaded, meta, world, rank=rank, model_file=model_file)
        shapes = {t.name: (t.local_shape, t.local_bytes) for t in predicted.tensors}
        assert shapes == real[rank]["shapes"], f"rank {rank}"
        assert predicted.ranks[rank].params == real[rank]["param_bytes"]
        counts = {}
        for c in predicted.collectives:
            counts[c.op] = counts.get(c.op, 0) + c.count
        assert counts == real[rank]["counts"], f"rank {rank}"


class Block(torch.nn.Module):
    """Identical blocks but for their index: odd ones run their MLP twice (one more all-reduce)."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.up = torch.nn.Linear(16, 32, bias=False)
        self.down = torch.nn.Linear(32, 16, bias=False)

    def forward(self, x):
        h = self.down(self.up(x))
        if self.index % 2:
            h = self.down(self.up(h))
        return x + h


class Alternating(torch.nn.Module):
    def __init__(self, blocks: int = 10):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(i) for i in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def alternating_input(batch: int, generator) -> torch.Tensor:
    return torch.randn(batch, 16, generator=generator)


def test_a_long_stack_is_stepped_on_four_blocks_and_extrapolated_exactly():
    """10 Llama blocks: the step on 2, 3 and 4 of them, extrapolated, equals the step on all 10, for
    every collective's count and bytes; blocks that act differently by index run whole."""
    from examples.llama import Transformer, example_input, loss

    plan = shardlang.load(ROOT / "plans" / "llama_2d.sl")
    with torch.device("meta"):
        model = Transformer(layers=10)
    fast = plan.explain(model, world_size=8, example_input=example_input, loss=loss)
    full = plan.explain(model, world_size=8, example_input=example_input, loss=loss, full_step=True)
    assert fast.collectives == full.collectives and {c.mesh_dim for c in full.collectives} == {"world.dp", "world.tp"}
    assert len(fast.notes) == 1 and "on 2, 3 and 4 of the 10 blocks of `layers`" in fast.notes[0]
    assert not full.notes

    plan = shardlang.loads(
        "shardlang 1\nmesh world = cpu[tp=2]\nparallelize layers.* on world.tp { up : colwise; down : rowwise }\n"
    )
    with torch.device("meta"):
        model = Alternating()
    fast = plan.explain(model, world_size=2, example_input=alternating_input)
    full = plan.explain(model, world_size=2, example_input=alternating_input, full_step=True)
    assert not fast.notes and fast.collectives == full.collectives
    # 15 MLP calls (5 even blocks once, 5 odd twice): a rowwise all-reduce forward each, and a colwise
    # input-gradient all-reduce backward each but the first, whose input needs no gradient.
    assert {(c.op, c.count) for c in full.collectives} == {("all_reduce", 15 + 14)}


def test_local_sizes_are_torchs():
    """explain's vectorised arithmetic for every rank agrees with torch's own for Shard and Replicate,
    uneven and empty shards included. (For FSDP's _StridedShard over uneven TP shards, what FSDP holds
    differs from DTensor's arithmetic; test_explain_equals_a_real_run checks that case on real ranks.)"""
    import itertools

    import numpy as np
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from torch.distributed.tensor import Replicate, Shard

    from shardlang.explain.simulate import local_sizes
    from shardlang.runtime.torchcompat import local_shape_and_offset

    @st.composite
    def cases(draw):
        mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
        shape = tuple(draw(st.lists(st.integers(0, 13), min_size=1, max_size=3)))
        placements = [draw(st.sampled_from([Replicate()] + [Shard(d) for d in range(len(shape))])) for _ in mesh]
        return shape, mesh, tuple(placements)

    @settings(max_examples=300, deadline=None)
    @given(cases())
    def agrees(case):
        shape, mesh, placements = case
        coords = np.array(list(itertools.product(*[range(n) for n in mesh])), dtype=np.int64)
        mine = local_sizes(shape, mesh, placements, coords)
        assert mine is not None
        for row, coordinate in zip(mine, coords):
            assert tuple(row) == tuple(local_shape_and_offset(shape, mesh, [int(c) for c in coordinate], placements)[0])

    agrees()


EXAMPLES = sorted((ROOT / "plans").glob("*.sl"))


def test_every_example_plan_explains_at_world_1024_without_real_memory():
    """80 layers of dim 8192 (the Llama example scaled) at 1024 ranks, tp 8 where a plan takes it, each
    in its own process whose peak RSS stays under 2 GiB."""
    for plan in EXAMPLES:
        model = model_of(f"plans/{plan.name}")
        source = ["--entry", "examples.llama:build_large"] if model == "examples/llama.py" else [model]
        params = ["-D", "tp=8"] if re.search(r"^param tp\b", plan.read_text(), re.MULTILINE) else []
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "shardlang",
                "explain",
                f"plans/{plan.name}",
                *source,
                "--world",
                "1024",
                *params,
                "--format",
                "json",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, (plan.name, done.stderr[-2000:])
        data = __import__("json").loads(done.stdout)
        assert data["world_size"] == 1024 and data["tensors"]
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        assert peak < 2 * 2**30, f"{plan.name}: peak RSS {peak / 2**30:.2f} GiB"


def test_svg_has_one_block_per_shard():
    plan = shardlang.load(ROOT / "plans" / "llama_2d.sl")
    model_file = load_model_file(str(ROOT / "examples" / "llama.py"))
    from shardlang.explain.pictures import render_svg

    e = explain(plan, model_file.build_on_meta(), 4, rank=0, model_file=model_file, blocks_for="layers.0.**")
    svg = render_svg(e, "layers.0.**")
    root = ET.fromstring(svg)
    rects = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.get("class") == "shard"]
    picked = [t for t in e.tensors if t.blocks]
    assert len(rects) == sum(len(t.blocks) for t in picked)
    wq = next(t for t in picked if t.name == "layers.0.attention.wq.weight")
    assert [b[2] for b in wq.blocks] == [(0,), (2,), (1,), (3,)]  # (dp, tp) = (0,0) (1,0) (0,1) (1,1) down the rows
    norm = next(t for t in picked if t.name == "layers.0.attention_norm.weight")
    assert [b[2] for b in norm.blocks] == [(0, 1), (2, 3)]  # dp shards it, tp replicates it


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("explain_mlp_tp", ["explain", "plans/mlp_tp.sl", "examples/mlp.py", "--world", "2"]),
        (
            "explain_llama_grid",
            [
                "explain",
                "plans/llama_2d.sl",
                "examples/llama.py",
                "--world",
                "4",
                "--rank",
                "1",
                "--param",
                "layers.0.attention.{wq,wo}.weight",
            ],
        ),
    ],
)
def test_text_rendering_is_pinned(name, args, golden):
    done = subprocess.run(
        [sys.executable, "-m", "shardlang", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    golden(FIXTURES / "cli" / f"{name}.txt", done.stdout)


def test_library_explain_and_json_data():
    import torch

    from examples.mlp import build_model, example_input

    plan = shardlang.load(ROOT / "plans" / "mlp_tp.sl")
    with torch.device("meta"):
        model = build_model()
    e = plan.explain(model, world_size=4, rank=3, example_input=example_input)
    assert e.rank == 3 and len(e.ranks) == 4
    assert {c.op for c in e.collectives} == {"all_reduce"}
    assert next(t for t in e.tensors if t.name == "net1.weight").local_shape == (8, 16)
    assert all(p.device.type == "meta" for p in model.parameters())  # the model was copied, not changed
