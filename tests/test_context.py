"""Context parallelism (shardlang/runtime/context*.py): a sequence split over ranks by its layout (head-tail,
plain, or the tests' own striped one, plugged in as one class), and SDPA on each rank's queries against the
gathered keys and values, on CPU (gloo)."""

from __future__ import annotations

import pytest
import torch

from shardlang.runtime.context_attention import KeySource
from shardlang.runtime.context_layout import LAYOUTS, Contiguous, HeadTail

from . import context_jobs
from .context_jobs import Striped

KINDS = (HeadTail, Contiguous, Striped)


def test_head_tail_gives_each_rank_an_early_and_a_late_chunk():
    assert HeadTail(2).positions(8, 0).tolist() == [0, 1, 6, 7]
    assert HeadTail(2).positions(8, 1).tolist() == [2, 3, 4, 5]
    assert Contiguous(2).positions(8, 1).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"does not split into 8 equal chunks \(2 x 4 ranks, head-tail\)"):
        HeadTail(4).positions(12, 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_a_layout_splits_and_joins_back_to_the_whole(kind, ranks):
    """Each layout's shards, joined, are the sequence again; every position is held by one rank; each
    rank's chunks are in sequence order (the causal block of its own keys needs it)."""
    layout = kind(ranks)
    x = torch.arange(3 * 48).reshape(3, 48)
    shards = [layout.split(x, 1, r) for r in range(ranks)]
    assert torch.equal(layout.join(shards, 1), x)
    held = torch.cat([layout.positions(48, r) for r in range(ranks)])
    assert sorted(held.tolist()) == list(range(48))
    assert all(list(layout.chunks(r)) == sorted(layout.chunks(r)) for r in range(ranks))


def test_a_new_layout_is_one_class_that_changes_who_holds_what():
    """The tests' Striped layout, a subclass naming only its chunks: rank 0 of 2 holds other positions than
    under head-tail or a plain split, and its causal blocks read the chunks between its own."""
    assert [kind(2).positions(8, 0).tolist() for kind in KINDS] == [[0, 1, 6, 7], [0, 1, 2, 3], [0, 1, 4, 5]]
    blocks = [(b.first, b.end, b.keys, b.key_first, b.key_end, b.causal) for b in Striped(2).blocks(1, 4, True)]
    # rank 1 holds chunks 1 and 3 (2 positions each): chunk 0 for both, chunk 2 for chunk 3's queries
    assert blocks == [(0, 4, "local", 0, 4, True), (0, 4, "whole", 0, 2, False), (2, 4, "whole", 4, 6, False)]


def test_the_languages_load_balancers_are_the_runtimes_layouts():
    from shardlang.frontend.schema import LOAD_BALANCERS

    assert set(LOAD_BALANCERS) == set(LAYOUTS)
    assert all(LAYOUTS[name].name == name for name in LAYOUTS)


class HeldKeys(KeySource):
    """A key source of the test's own: keys held here (in the kernel's device and dtype), their gradients
    summed into float64 buffers on the CPU."""

    def __init__(self, key, value, into):
        self.key, self.value, self.into = key, value, into

    def range(self, first, end):
        return self.key[..., first:end, :], self.value[..., first:end, :]

    def add(self, first, end, *parts):
        for total, part in zip(self.into, parts):
            total[..., first:end, :] += part.double().to(total.device)


def _blocked_against_the_whole(kernel, device, dtype, ranks, causal, kind, kv_heads=4):
    """Every rank's blocks (its layout's `blocks`), computed here with the keys every rank would gather,
    through `kernel`: the output and the query, key and value gradients put back in sequence order (the
    keys' summed over the ranks, as the reduce-scatter sums them), against SDPA on the whole sequence in
    float64. Returns the largest difference of each, and that of SDPA itself in `dtype`."""
    import torch.nn.functional as F

    from shardlang.runtime.context_attention import attend, attend_backward

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, 64, 64, generator=g, dtype=torch.float64) for _ in range(2))
    upstream = torch.randn(2, 4, 64, 64, generator=g, dtype=torch.float64)
    gqa = {"enable_gqa": True} if kv_heads != 4 else {}
    exact = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*exact, is_causal=causal, **gqa)
    (out * upstream).sum().backward()
    typed = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    (F.scaled_dot_product_attention(*typed, is_causal=causal, **gqa) * upstream.to(device, dtype)).sum().backward()
    plain = {"output": out.detach(), **{f"{n}_grad": t.grad for n, t in zip("qkv", exact)}}
    plain_error = max(float((t.grad.double().cpu() - w.grad).abs().max()) for t, w in zip(typed, exact))

    outs, grads = [], {"q_grad": [], "k_grad": [], "v_grad": []}
    whole_grads = [torch.zeros_like(t) for t in (k, v)]
    typed_kv = [t.to(device, dtype) for t in (k, v)]
    layout = kind(ranks)

    for rank in range(ranks):
        mine = [layout.split(t, 2, rank).to(device, dtype) for t in (q, k, v)]
        own = [torch.zeros_like(t, dtype=torch.float64, device="cpu") for t in mine[1:]]
        sources = {"local": HeldKeys(*mine[1:], own), "whole": HeldKeys(*typed_kv, whole_grads)}
        blocks = layout.blocks(rank, mine[0].shape[-2], causal)
        local, lse, rests = attend(kernel, mine[0], sources, blocks, 64**-0.5)
        grad = layout.split(upstream, 2, rank).to(device, dtype)
        dq = attend_backward(kernel, grad, mine[0], sources, blocks, rests, local, lse, 64**-0.5)
        outs.append(local.double().cpu())
        grads["q_grad"].append(dq.double().cpu())
        grads["k_grad"].append(own[0])
        grads["v_grad"].append(own[1])
    joined = {"output": layout.join(outs, 2)}
    joined.update({name: layout.join(parts, 2) for name, parts in grads.items()})
    joined["k_grad"] += whole_grads[0]
    joined["v_grad"] += whole_grads[1]
    errors = {name: (joined[name] - plain[name]).abs().max().item() for name in joined}
    return errors, plain_error


KERNELS = [("cpu", "cpu", torch.float64), ("math", "cpu", torch.float64)] + [
    pytest.param(kernel, "cuda", torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA"))
    for kernel in ("cudnn", "flash", "math")
]


@pytest.mark.parametrize(("kernel", "device", "dtype"), KERNELS)
@pytest.mark.parametrize(
    ("ranks", "causal", "kind", "kv_heads"),
    [
        (2, True, HeadTail, 4),
        (4, True, HeadTail, 2),
        (4, True, Contiguous, 4),
        (2, False, HeadTail, 4),
        (4, True, Striped, 2),
    ],
)
def test_each_kernels_blocks_merged_equal_attention_on_the_whole(kernel, device, dtype, ranks, causal, kind, kv_heads):
    """Each rank's blocks, merged by log-sum-exp, and their backward against the merged output: the whole
    sequence's attention and gradients, to float64's precision on CPU, and on GPUs (bf16, CUDA's cuDNN and
    flash kernels) within twice SDPA's own bf16 error."""
    if kernel == "cudnn":
        from shardlang.runtime.context_attention import attention_kernel

        if attention_kernel(torch.zeros(1, 1, 8, 64, device=device, dtype=dtype)) != "cudnn":
            pytest.skip("cuDNN attention is not available here")
    errors, plain = _blocked_against_the_whole(kernel, device, dtype, ranks, causal, kind, kv_heads)
    bound = 1e-12 if dtype == torch.float64 else 2 * plain + 1e-3
    assert max(errors.values()) < bound, (errors, plain)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("causal", "kind"), [(True, HeadTail), (True, Contiguous), (False, HeadTail), (True, Striped)])
def test_attention_over_a_split_sequence_equals_the_whole(pools, world, causal, kind):
    for errors in pools(world).run(context_jobs.attention_matches_whole, causal, kind):
        assert max(errors.values()) < 1e-12, errors


@pytest.mark.distributed
def test_grouped_query_attention_too(pools):
    for errors in pools(2).run(context_jobs.attention_matches_whole, True, HeadTail, True):
        assert max(errors.values()) < 1e-12, errors


@pytest.mark.distributed
def test_unbalanced_shards_under_a_head_tail_mask_are_wrong(pools):
    """The planted fault the checks must catch: shards cut plainly while the mask assumes head-tail."""
    errors = pools(2).run(context_jobs.mask_of_the_other_layout)
    assert min(e["output"] for e in errors) > 1e-3, errors


ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
PLAN = ROOT / "plans" / "llama_cp.sl"


def _error(text: str) -> str:
    import shardlang

    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.loads("mesh world = cpu[dp=2, cp=2]\n" + text)
    found = raised.value.diagnostics[0]
    return f"{found.code} {found.span.line}:{found.span.col} {found.message}"


def test_the_statement():
    import shardlang

    plan = shardlang.load(PLAN)
    cp = plan.context_parallel
    assert str(cp.mesh) == "world.cp" and [str(t) for t in cp.targets] == ["layers.*.attention"]
    assert cp.load_balance == "headtail"
    plain = shardlang.loads(PLAN.read_text().replace("load_balance = headtail", "load_balance = none"))
    assert plain.context_parallel.load_balance == "none"
    unsaid = shardlang.loads(PLAN.read_text().replace("load_balance = headtail", ""))
    assert unsaid.context_parallel.load_balance == "headtail"
    assert _error("context_parallel on world.cp { each a }\ncontext_parallel on world.cp { each a }").startswith(
        "SL103 3:1 context_parallel is given twice"
    )
    assert _error("context_parallel on world.cp { }").startswith("SL102 2:1 context_parallel names no attention")
    assert _error("context_parallel on world[dp, cp] { each a }").startswith("SL107 2:21")
    assert _error("context_parallel on world.cp { each a; load_balance = zigzag }").startswith(
        "SL101 2:55 unknown load"
    )
    assert _error("context_parallel on world.cp { each a (x=1) }").startswith("SL101")


def test_a_cp_dim_nothing_reduces_or_tp_also_splits_is_sl219():
    import shardlang
    from examples.llama import Transformer

    with torch.device("meta"):
        model = Transformer()

    def codes(text: str) -> list[tuple[str, int]]:
        return [(d.code, d.span.line) for d in shardlang.loads(text).lint(model, world_size=4) if d.is_error]

    base = "mesh world = cpu[dp=2, cp=2]\ncontext_parallel on world.cp { each layers.*.attention }\n"
    assert codes(base + "fully_shard on world.dp { each layers.* }") == [("SL219", 2)]
    # (the fully_shard block over a dim a parallelize block splits is SL218 besides)
    assert ("SL219", 3) in codes(
        base + "parallelize on world.cp { output : colwise }\nfully_shard on world[dp*cp] { each layers.* }"
    )
    assert codes(base + "fully_shard on world[dp*cp] { each layers.* }") == []


@pytest.mark.distributed
def test_positions_left_unshifted_fail_the_gradients_check(tmp_path, pools):
    """The plan passes; the same model computing each shard's rotary angles from 0 (it takes no
    position_ids, so nothing can give it the shard's positions) fails the gradients check."""
    import shardlang
    from shardlang.launch.job import Job, run

    unshifted = tmp_path / "unshifted.py"
    unshifted.write_text(
        "from examples.llama import Transformer, example_input, loss  # noqa: F401\n\n\n"
        "class FromZero(Transformer):\n    def forward(self, tokens):\n        return super().forward(tokens)\n\n\n"
        "def build_model():\n    return FromZero()\n"
    )
    # (the plan itself passes with examples/llama.py: test_apply_cli runs every plan)
    checks = shardlang.load(PLAN).checks
    wrong = pools(4).run(run, Job(str(PLAN), {}, str(unshifted), None, checks))[0]
    gradients = next(c for c in wrong.checks if c.check == "gradients")
    assert gradients.status == "fail", gradients.message


@pytest.mark.distributed
def test_a_module_that_calls_no_sdpa_is_named_at_the_statement(tmp_path):
    from .conftest import shardlang_cli

    path = tmp_path / "plan.sl"
    path.write_text(PLAN.read_text().replace("each layers.*.attention", "each layers.*.feed_forward"))
    done = shardlang_cli("apply", path, ROOT / "examples" / "llama.py", "--nproc", "4")
    assert done.returncode == 1
    assert "called no scaled_dot_product_attention" in done.stdout + done.stderr
    assert f"{path}:11:1: error[SL400] raised in module 'layers.0.feed_forward'" in done.stdout + done.stderr


@pytest.mark.distributed
@pytest.mark.parametrize("balancer", ["headtail", "none"])
def test_the_printed_program_splits_attends_and_gathers_as_apply_does(pools, balancer):
    text = PLAN.read_text().replace("load_balance = headtail", f"load_balance = {balancer}")
    for difference in pools(4).run(context_jobs.printed_program_runs_like_apply, text):
        assert difference < 1e-5, difference


@pytest.mark.parametrize(
    ("balancer", "pasted", "not_pasted"), [("headtail", "HeadTail", "Contiguous"), ("none", "Contiguous", "HeadTail")]
)
def test_the_printed_program_pastes_what_its_context_parallel_line_reaches(balancer, pasted, not_pasted):
    """The step names its roots (context_parallel, context_shard, the plan's layout); emit.python's walk
    pastes what they reach, each once, and nothing of another layout: every shardlang function or class
    a pasted one calls is defined in the program (as test_apply's pasted-helper test asks of the table's)."""
    import re

    import shardlang
    from shardlang.runtime import context, context_attention, context_layout

    text = PLAN.read_text().replace("load_balance = headtail", f"load_balance = {balancer}")
    code = shardlang.loads(text).to_python()
    assert f"context_parallel(model, ('layers.*.attention',), world['cp'], {pasted})" in code
    assert f"class {pasted}(SequenceLayout):" in code and f"class {not_pasted}(" not in code
    defined = re.findall(r"^(?:def|class) (\w+)", code, flags=re.M)
    ours = {
        name
        for module in (context, context_attention, context_layout)
        for name, obj in vars(module).items()
        if getattr(obj, "__module__", None) == module.__name__
    }
    assert {"context_parallel", "context_shard", "ContextAttention", "GatheredKeys", "Block"} <= set(defined)
    assert all(defined.count(name) == 1 for name in defined if name in ours)
    assert "LAYOUTS" not in code and "sequence_layout" not in defined  # the runtime's lookup by name stays behind

    namespace: dict = {}
    exec(compile(code, "printed.py", "exec", dont_inherit=True), namespace)
    for name in set(defined) & ours:
        lacking = {n for c in _code_objects(namespace[name]) for n in _names_loaded(c) if n in ours} - set(namespace)
        assert not lacking, (name, lacking)


def _code_objects(obj) -> list:
    """A function's code, or a class's: its methods', static methods' and properties'."""
    import types

    if not isinstance(obj, type):
        return [obj.__code__]
    members = vars(obj).values()
    functions = [
        m.__func__ if isinstance(m, staticmethod) else m.fget if isinstance(m, property) else m for m in members
    ]
    return [f.__code__ for f in functions if isinstance(f, types.FunctionType)]


def _names_loaded(code) -> set[str]:
    import types

    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_loaded(const)
    return names


@pytest.mark.distributed
def test_a_layout_plugged_in_as_one_class_passes_the_checks(tmp_path, pools):
    """plans/llama_cp.sl with the tests' Striped layout (registered in the worker: its name in the plan
    language's load_balance choice and in LAYOUTS): every check passes, the gradients' among them."""
    import shardlang
    from shardlang.launch.job import Job

    path = tmp_path / "striped.sl"
    path.write_text(PLAN.read_text().replace("load_balance = headtail", "load_balance = striped"))
    checks = shardlang.load(PLAN).checks
    job = Job(str(path), {}, str(ROOT / "examples" / "llama.py"), None, checks)
    report = pools(4).run(context_jobs.striped_plan_applied, job)[0]
    assert report.ok, [(c.check, c.status, c.message) for c in report.checks]
    assert {c.check: c.status for c in report.checks}["gradients"] == "pass"


@pytest.mark.distributed
def test_a_sequence_that_does_not_split_is_found_by_lint_at_the_statement(tmp_path):
    """lint's simulated step runs the hooks: 8 tokens do not split into 2 x 3 head-tail chunks."""
    from .conftest import shardlang_cli

    path = tmp_path / "cp3.sl"
    path.write_text(PLAN.read_text().replace("cp=2", "cp=3"))
    done = shardlang_cli("lint", path, ROOT / "examples" / "llama.py", "--world", "6")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{path}:11:1: error[SL220]" in done.stdout, done.stdout
    assert "a sequence of 8 does not split into 6 equal chunks (2 x 3 ranks, head-tail)" in done.stdout


def test_fullgraph_compile_around_context_parallel_attention_is_sl301():
    """dynamo cannot trace the attention's mode and collectives in one graph: said at the compile line;
    without fullgraph the plan lints clean (the step then runs: test_apply_cli's plans and this file's)."""
    import shardlang
    from examples.llama import Transformer

    with torch.device("meta"):
        model = Transformer()
    text = PLAN.read_text() + "compile layers.* (fullgraph=true)\n"
    found = [d for d in shardlang.loads(text).lint(model, world_size=4) if d.is_error]
    assert {(d.code, d.span.line) for d in found} == {("SL301", 22)}, found
    assert "inside which context_parallel runs attention (layers.0.attention)" in found[0].message
    relaxed = shardlang.loads(text.replace(" (fullgraph=true)", "")).lint(model, world_size=4)
    assert not [d for d in relaxed if d.is_error]


@pytest.mark.distributed
def test_local_output_leaves_each_rank_its_shard_and_cuts_the_labels_alike(pools, tmp_path):
    """`output = local` (the loss on each rank's shard, as torch's context_parallel users take it): every
    check passes (they gather the shards themselves: test_apply_cli does not run it, so here), the model
    returns the rank's shard, and the ranks' local losses average to the whole sequence's loss (the 8
    tokens split into 4 equal chunks, one label of the last masked: nearly equal counts)."""
    import shardlang
    from shardlang.launch.job import Job, run

    text = PLAN.read_text().replace("load_balance = headtail", "load_balance = headtail\n    output = local")
    plan = shardlang.loads(text)
    assert plan.context_parallel.whole_output is False
    path = tmp_path / "local.sl"
    path.write_text(text)
    report = pools(4).run(run, Job(str(path), {}, str(ROOT / "examples" / "llama.py"), None, plan.checks))[0]
    assert report.ok, [(c.check, c.status, c.message) for c in report.checks]
    for result in pools(4).run(context_jobs.local_output_and_its_labels, text):
        assert result["shape"] == (2, 4, 64), result
        assert abs(result["mean_of_local"] - result["whole"]) < 0.05, result


@pytest.mark.distributed
def test_a_pipeline_with_local_outputs_passes(tmp_path, pools):
    """plans/llama_cp_pipeline.sl with `output = local`: the last stage returns each rank's shard of the
    sequence, which the checks gather for the loss (the plan as it is, gathering its output itself, runs
    with every plan in test_apply_cli)."""
    import shardlang
    from shardlang.launch.job import Job, run

    text = (ROOT / "plans" / "llama_cp_pipeline.sl").read_text()
    plan = tmp_path / "local.sl"
    plan.write_text(text.replace("each layers.*.attention", "each layers.*.attention\n    output = local"))
    checks = shardlang.load(plan).checks
    report = pools(4).run(run, Job(str(plan), {}, str(ROOT / "examples" / "llama.py"), None, checks))[0]
    assert {c.check: c.status for c in report.checks}["gradients"] == "pass", report.checks


def test_init_writes_context_parallel_over_each_blocks_attention():
    """`shardlang init --cp 2`: context_parallel over the attention module of each block, FSDP reducing
    over dp*cp; the plan lints clean."""
    import shardlang
    from examples.llama import Transformer
    from shardlang.compiler.starter import init_plan

    with torch.device("meta"):
        model = Transformer()
    text = init_plan(model, cp=2)
    assert "mesh world = auto[dp=auto, cp=2]" in text
    assert "context_parallel on world.cp {\n    each layers.*.attention\n}" in text
    assert "fully_shard on world[dp*cp] {" in text
    assert not [d for d in shardlang.loads(text).lint(model, world_size=4) if d.is_error]


@pytest.mark.distributed
def test_a_transformers_decoder_without_a_cache_is_one_sequence_not_packed_ones(tmp_path, pools):
    """transformers' Llama with use_cache=False (as in training): the head-tail shard's positions jump,
    which transformers reads as packed sequences and masks apart, unless context parallelism says they are
    one sequence's. lint's step (fake tensors) is clean, and every check passes at world 2."""
    pytest.importorskip("transformers")
    import shardlang
    from shardlang.launch.job import Job, run

    model = tmp_path / "uncached_llama.py"
    model.write_text(
        "from transformers import LlamaForCausalLM\n\n"
        "from examples.hf_llama import config, example_input, loss  # noqa: F401\n\n\n"
        "def build_model():\n    return LlamaForCausalLM(config().__class__(**{**config().to_dict(), 'use_cache': False}))\n"
    )
    plan = ROOT / "plans" / "hf" / "llama_cp.sl"
    from shardlang.cli.main import main

    assert main(["lint", str(plan), str(model), "--world", "2"]) == 0
    report = pools(2).run(run, Job(str(plan), {}, str(model), None, shardlang.load(plan).checks))[0]
    assert report.ok, [(c.check, c.status, c.message) for c in report.checks]
    assert {c.check: c.status for c in report.checks}["gradients"] == "pass"
