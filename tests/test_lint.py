"""Model-aware lint (SL200-SL217): each fixture plan against its model, through the CLI, with the
codes and positions of its `# expect:` lines; and lint at a world of 1024 in one process."""

import importlib.util
import json
import re
import time
from pathlib import Path

import pytest
import torch

import shardlang
from shardlang.cli import main

from .conftest import FIXTURES, ROOT

LINT = sorted((FIXTURES / "lint").glob("*.sl"))


def _header(text: str, key: str) -> str | None:
    found = re.search(rf"^# {key}: (\S+)$", text, re.MULTILINE)
    return found.group(1) if found else None


def _stepping(path: Path) -> bool:
    """Fixtures whose findings come from lint's simulated step (`# step: yes`); the others lint --no-step."""
    return _header(path.read_text(), "step") == "yes"


@pytest.mark.parametrize(
    "path",
    # The simulated step runs in a forked child holding a (fake) process group: the distributed lane.
    [pytest.param(p, marks=[pytest.mark.distributed] if _stepping(p) else []) for p in LINT],
    ids=lambda p: p.name,
)
def test_lint_fixture_reports_expected_codes(path: Path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    text = path.read_text()
    needs = _header(text, "needs")
    if needs is not None and importlib.util.find_spec(needs) is None:
        pytest.skip(f"needs {needs}")
    model = ["--entry", _header(text, "entry")] if _header(text, "entry") else [_header(text, "model")]
    step = [] if _stepping(path) else ["--no-step"]
    world = ["--world", _header(text, "world")]
    status = main(["lint", str(path.relative_to(ROOT)), *model, *world, *step, "--format", "json"])
    found = [(d["code"], d["line"], d["col"]) for d in json.loads(capsys.readouterr().out)]
    expected = [
        (c, int(line), int(col)) for c, line, col in re.findall(r"^# expect: (SL\d+) (\d+):(\d+)$", text, re.MULTILINE)
    ]
    assert expected, f"{path.name} has no expect lines"
    assert found == expected
    errors = any(code not in ("SL203", "SL206", "SL209", "SL210") for code, _, _ in found)
    assert status == (1 if errors else 0)


def test_lint_text_output_names_the_modules(capsys, monkeypatch, golden):
    monkeypatch.chdir(ROOT)
    status = main(["lint", "tests/fixtures/lint/sl201_two_rules.sl", "examples/llama.py", "--world", "4"])
    out, err = capsys.readouterr()
    golden(FIXTURES / "cli" / "lint_model_sl201.txt", f"exit: {status}\n--- stdout\n{out}--- stderr\n{err}")


def test_lint_with_model_needs_a_world_for_auto_dims(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["lint", "plans/llama_2d.sl", "examples/llama.py"]) == 2
    assert "give the world size with --world N" in capsys.readouterr().err


def test_lint_at_world_1024_in_one_process():
    """An 80-layer Llama structure on the meta device, linted at 1024 ranks (dp 128 x tp 8)."""
    import examples.llama as llama

    plan = shardlang.load(ROOT / "plans" / "llama_2d.sl", params={"tp": 8})
    with torch.device("meta"):
        model = llama.Transformer(vocab=32768, dim=4096, heads=32, layers=80, hidden=14336, seq=2048)
    start = time.perf_counter()
    found = plan.lint(model, world_size=1024)
    assert time.perf_counter() - start < 60  # a few seconds idle: a bound for a blow-up, not for a busy machine
    assert [d.code for d in found] == []


HAS_TRANSFORMERS = __import__("importlib.util").util.find_spec("transformers") is not None


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("plan", "model"),
    [
        ("init meta\n", "examples/encoder.py"),  # nn.MultiheadAttention initialises in _reset_parameters
        pytest.param(
            "init meta\n",
            "examples/hf_qwen3.py",
            marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs pip install -e '.[hf]'"),
        ),
        pytest.param(  # transformers' init_weights on the root initialises every module below it
            "init meta with init_weights\n",
            "examples/hf_qwen3.py",
            marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs pip install -e '.[hf]'"),
        ),
    ],
)
def test_init_meta_knows_the_models_own_initialisers(plan, model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "plan.sl"
    path.write_text("mesh world = cpu[dp=auto]\nfully_shard on world.dp { }\n" + plan)
    status = main(["lint", str(path), model, "--world", "2", "--format", "json"])
    assert status == 0 and json.loads(capsys.readouterr().out) == []


PLANS = sorted(
    [*ROOT.glob("plans/*.sl"), *ROOT.glob("plans/hf/*.sl"), *ROOT.glob("plans/seeds/*.sl")]
    + [*(FIXTURES / "valid").glob("*.sl")],
    key=str,
)


@pytest.mark.parametrize("path", PLANS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_plan_uses_each_mesh_dim_it_declares(path):
    """SL217's premise on every plan we ship: each dim that can be larger than 1 is named by some statement
    (parallelize, fully_shard, replicate, sync over, pipeline), so SL217 fires on none of them."""
    from shardlang.compiler.rules.meshes import used_dims

    plan = shardlang.load(path)
    used = used_dims(plan)
    meshes = {mesh for mesh, _ in used}
    unused = [
        f"{m.name}.{d.name}"
        for m in plan.meshes
        if m.name in meshes
        for d in m.dims
        if (m.name, d.name) not in used and d.size != 1
    ]
    assert not unused


@pytest.mark.parametrize(
    ("statements", "found"),
    [
        ("fully_shard on world.dp { }", ["SL217"]),  # tp: nothing
        ("fully_shard on world { }", []),  # a bare mesh names every dim (HSDP)
        ("replicate on world.dp { }\nsync over world.tp", []),
        ("fully_shard on world.dp { }\npipeline on world.tp { split layers.* into auto }", []),
    ],
)
def test_sl217_counts_every_statement_that_names_a_dim(statements, found):
    import examples.llama_pipeline as llama

    plan = shardlang.loads(f"mesh world = cpu[dp=2, tp=2]\n{statements}\n")
    with torch.device("meta"):
        model = llama.build_model()
    assert [d.code for d in plan.lint(model, world_size=4) if d.code == "SL217"] == found


def test_sl217_leaves_size_one_dims_and_unused_meshes_alone():
    import examples.mlp as mlp

    plan = shardlang.loads("mesh world = cpu[dp=2, tp=1]\nmesh other = cpu[x=2]\nfully_shard on world.dp { }\n")
    with torch.device("meta"):
        assert plan.lint(mlp.build_model(), world_size=2) == []


def _titan():
    pytest.importorskip("torchtitan")
    from shardlang.runtime.modelfile import load_model_file

    return load_model_file(str(ROOT / "examples" / "titan_llama3.py"))


def test_sl210_follows_the_order_modules_run_in_not_their_declaration():
    """torchtitan's TransformerBlock declares feed_forward before ffn_norm and runs it after: in
    declaration order the norm a plan dropped from sequence parallelism looked replicated-in (silent)."""
    from shardlang.compiler.lint import lint
    from shardlang.compiler.trace import trace_order

    model_file = _titan()
    model = model_file.build_on_meta()
    order = trace_order(model, model_file.example_input)
    assert order.traced, order.why
    assert order.modules.index("layers.0.ffn_norm") < order.modules.index("layers.0.feed_forward")
    for name, modules in [("ffn_norm", "layers.0.ffn_norm, layers.1.ffn_norm"), ("final_norm", "norm")]:
        plan = shardlang.load(FIXTURES / "lint" / f"sl210_titan_{name}.sl")
        assert [d.code for d in lint(plan, model, 4).diagnostics] == []  # what declaration order saw
        (found,) = lint(plan, model, 4, order=order).diagnostics
        assert found.code == "SL210" and found.help[0] == f"modules: {modules}"


def test_sl210_says_when_it_could_not_trace():
    import tests.faults.seq_norm as seq_norm

    plan = shardlang.load(FIXTURES / "lint" / "sl210_norm_outside_sp.sl")
    with torch.device("meta"):
        (found,) = plan.lint(seq_norm.build_model(), world_size=2)
    assert "taken in the order they are declared, not run" in found.help[-1]


def test_a_forward_that_never_returns_is_not_traced_for_ever(monkeypatch):
    """The trace runs the user's forward in the command's own process, before any worker (and its
    --timeout) exists: a forward that never returns leaves the order unknown after TRACE_S, saying so."""
    import time
    import types

    from shardlang.cli import inputs

    class Hangs(torch.nn.Module):
        def forward(self, x):
            while True:
                time.sleep(0.01)

    monkeypatch.setattr(inputs, "TRACE_S", 0.3)
    start = time.monotonic()
    model_file = types.SimpleNamespace(example_input=lambda batch, g: torch.zeros(batch, 2), origin="hangs.py")
    order = inputs.order_always(Hangs(), model_file)
    assert not order.traced and "did not finish within 0.3 s" in order.why, order
    assert time.monotonic() - start < 60  # the forward never returns: any bound shows TRACE_S acted


def test_a_misspelt_rule_names_every_module_it_was_meant_for():
    """The newcomer's typo under `layers.*`: SL210 once named w3 alone (declared after w2, run before it);
    the typo's SL200 now names both modules that lost the rule, and SL210 no longer misreads the order."""
    from shardlang.compiler.lint import lint
    from shardlang.compiler.trace import trace_order
    from shardlang.runtime.modelfile import load_model_file

    text = (ROOT / "plans" / "llama_2d.sl").read_text().replace("feed_forward.{w1,w3}", "feed_forwad.{w1,w3}")
    model_file = load_model_file(str(ROOT / "examples" / "llama.py"))
    model = model_file.build_on_meta()
    found = lint(shardlang.loads(text), model, 4, order=trace_order(model, model_file.example_input)).diagnostics
    assert [d.code for d in found] == ["SL200"]
    assert found[0].help[-1] == (
        "so the rule reaches none of the modules it was meant for: feed_forward.w1, feed_forward.w3"
    )


@pytest.mark.parametrize(
    ("old", "new", "help"),
    [
        (
            "feed_forward.{w1,w3}",
            "feed_forwrd.{w1,w3}",
            "there is no 'feed_forwrd' under layers.0; did you mean 'feed_forward'?",
        ),
        ("attention.{wq,wk,wv}", "attention.wkk", "there is no 'wkk' under layers.0.attention; did you mean 'wk'?"),
        ("attention.{wq,wk,wv}", "attention.wk.x", "layers.0.attention.wk has no submodules"),
        ("    norm ", "    nrm  ", "there is no 'nrm' at the top; did you mean 'norm'?"),  # no block scope
    ],
)
def test_sl200_says_where_a_scoped_name_was_looked_for(old, new, help):
    """A rule of `parallelize layers.*` is relative to each layer: its typo is looked for under layers.0 (the
    first scope), and the help says so instead of `at the top`, the model's root, where nobody wrote it."""
    import examples.llama as llama

    plan = shardlang.loads((ROOT / "plans" / "llama_2d.sl").read_text().replace(old, new, 1))
    with torch.device("meta"):
        found = [d for d in plan.lint(llama.build_model(), world_size=4) if d.code == "SL200"]
    assert [d.help[0] for d in found] == [help]


class _LayerDrop(torch.nn.Module):
    """Four blocks, each skipped at random in training with probability 1/2 (LayerDrop)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand([]) < 0.5:
                continue
            x = layer(x)
        return x


def test_blocks_layerdrop_skips_in_the_trace_are_still_a_stack_and_init_says_so():
    """The trace draws from one seed (the same order every run), and the blocks LayerDrop skipped by its
    draw ran in an eval-mode forward: the stack gets its FSDP units, and a comment on what they need."""
    from shardlang.compiler.starter import block_stacks, init_plan
    from shardlang.compiler.trace import trace_order

    def example_input(batch, generator):
        return torch.randn(batch, 8, generator=generator)

    model = _LayerDrop()
    order = trace_order(model, example_input)
    assert order == trace_order(model, example_input)
    assert order.skipped and set(order.skipped) | {m for m in order.modules if m.startswith("layers.")} == {
        f"layers.{i}" for i in range(4)
    }
    assert block_stacks(model, order) == ("layers",)
    text = init_plan(model, name="layerdrop", order=order)
    assert "    each layers.*" in text and "skipped at random in training (LayerDrop" in text
    model.eval()  # in eval mode every block runs: nothing skipped, nothing said
    order = trace_order(model, example_input)
    assert not order.skipped and "LayerDrop" not in init_plan(model, name="layerdrop", order=order)


FFN = "    feed_forward.{w1,w3}   : colwise\n"
FFN_PREPARE = "    feed_forward           : prepare_input(input=shard(1), desired=replicate)\n"
FFN_NORM = "    ffn_norm               : sequence_parallel\n"


def _llama_2d_without(*lines: str, typo: bool = False):
    """plans/llama_2d.sl with `lines` removed (and `feed_forward.{w1,w3}` misspelt when `typo`), and the
    Llama model on meta with the order its modules run in."""
    from shardlang.compiler.trace import trace_order
    from shardlang.runtime.modelfile import load_model_file

    text = (ROOT / "plans" / "llama_2d.sl").read_text()
    assert all(line in text for line in lines)
    for line in lines:
        text = text.replace(line, "")
    if typo:
        text = text.replace("feed_forward.{w1,w3}", "feed_forwrd.{w1,w3}")
    model_file = load_model_file(str(ROOT / "examples" / "llama.py"))
    model = model_file.build_on_meta()
    return shardlang.loads(text), model, trace_order(model, model_file.example_input)


def _sl210_modules(found) -> list[str]:
    return [d.help[0].removeprefix("modules: ") for d in found if d.code == "SL210"]


@pytest.mark.parametrize(("lines", "typo"), [((FFN,), False), ((), True)])
def test_sl210_in_declaration_order_names_both_siblings_that_lost_their_rule(lines, typo):
    """Issue 24: without the order modules run in, w3 (declared after w2 : rowwise, run before it) was named
    alone although w1 lost its rule too; the fix of the one named left the other. Both are named now."""
    from shardlang.compiler.lint import lint

    plan, model, _ = _llama_2d_without(*lines, typo=typo)
    found = [d for d in lint(plan, model, 4).diagnostics if d.code == "SL210"]
    assert _sl210_modules(found) == [
        "layers.0.feed_forward.w1, layers.0.feed_forward.w3, layers.1.feed_forward.w1, layers.1.feed_forward.w3"
    ]
    assert found[0].message.startswith("layers.0.feed_forward.w1.weight, layers.0.feed_forward.w3.weight")
    assert found[0].help[1].startswith("layers.0.feed_forward.w1, layers.1.feed_forward.w1 sit beside them")


def test_sl210_names_a_module_once_when_declaration_order_splits_siblings():
    """Without the norm's and the MLP's rules, declaration order read w1 under attention.wo's shards and w3
    under w2's: two SL210s split the siblings. One names them all now, as the traced order does."""
    from shardlang.compiler.lint import lint

    plan, model, order = _llama_2d_without(FFN_NORM, FFN_PREPARE, FFN)
    declared = _sl210_modules(lint(plan, model, 4).diagnostics)
    traced = _sl210_modules(lint(plan, model, 4, order=order).diagnostics)
    modules = ", ".join(f"layers.{i}.{m}" for i in (0, 1) for m in ("ffn_norm", "feed_forward.w1", "feed_forward.w3"))
    assert declared == traced == [modules]


@pytest.mark.parametrize(
    ("lines", "modules"),
    [
        ((FFN_NORM, FFN_PREPARE, FFN), ("ffn_norm", "feed_forward.w1", "feed_forward.w3")),
        (
            (FFN_NORM, FFN_PREPARE, "    feed_forward.w2        : rowwise(output=shard(1))\n"),
            ("ffn_norm", "feed_forward.w2"),
        ),
    ],
)
def test_sl210_names_every_module_that_lost_its_rule_in_the_order_they_run(lines, modules):
    """In the traced order one SL210 names every module of the chain that lost its rule, in the order they
    run: a regression that reports the first alone (or one per module) fails here."""
    from shardlang.compiler.lint import lint

    plan, model, order = _llama_2d_without(*lines)
    expected = [f"layers.{i}.{m}" for i in (0, 1) for m in modules]
    assert expected == sorted(expected, key=order.modules.index)
    assert _sl210_modules(lint(plan, model, 4, order=order).diagnostics) == [", ".join(expected)]


@pytest.mark.distributed  # the `use` style runs in a forked child holding a fake process group
@pytest.mark.parametrize("embedding, found", [("colwise", []), ("rowwise", ["SL204"])])
def test_sl204_sees_what_a_use_style_places(tmp_path, capsys, monkeypatch, embedding, found):
    """A tied weight, its output layer placed by a `use` style written by hand (Shard(1), as rowwise
    places it): lint runs the style in a simulated world, so a colwise embedding (Shard(1) too) is alike
    and a rowwise one (Shard(0)) is not; neither is a guess from the style's name or base class."""
    monkeypatch.chdir(ROOT)
    plan = tmp_path / "tied.sl"
    plan.write_text(
        "shardlang 1\nuse tests.faults.styles.rowwise_bias_once as by_hand\nmesh world = cpu[tp=auto]\n"
        f"parallelize on world.tp {{\n    embedding : {embedding}\n    fc : by_hand\n}}\n"
    )
    main(["lint", str(plan), "examples/tied.py", "--world", "2", "--no-step", "--format", "json"])
    assert [d["code"] for d in json.loads(capsys.readouterr().out)] == found


def test_colwise_on_a_norm_suggests_sequence_parallel(capsys, monkeypatch):
    """SL202 on an RMSNorm names `sequence_parallel`, the style made for norms, not "a style of your own"."""
    monkeypatch.chdir(ROOT)
    plan = ROOT / "tests" / "fixtures" / "lint" / "colwise_on_norm.sl"
    status = main(
        ["lint", str(plan.relative_to(ROOT)), "examples/llama.py", "--world", "2", "--no-step", "--format", "json"]
    )
    (found,) = json.loads(capsys.readouterr().out)
    assert (status, found["code"], found["line"]) == (1, "SL202", 7)
    assert "`sequence_parallel` runs it on each rank's shard of the sequence" in found["help"], found
