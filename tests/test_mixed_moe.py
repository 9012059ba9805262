"""Mixtures of experts under mixed precision (issue 39): ERNIE-4.5-MoE's router stays float32 inside a
bfloat16 unit, as transformers keeps it (compiler.float32), and the gradients check's references route each
token as the sharded run did (verification.routing), while a router that scores wrong still fails.
Skipped without transformers: pip install -e '.[hf]'."""

from __future__ import annotations

import copy
import re

import pytest
import torch

pytest.importorskip("transformers")

import shardlang  # noqa: E402
from shardlang.compiler.float32 import float32_units  # noqa: E402
from shardlang.compiler.lint import lint  # noqa: E402
from shardlang.compiler.lower import lower  # noqa: E402
from shardlang.compiler.program import FullyShard  # noqa: E402
from shardlang.compiler.starter import init_plan  # noqa: E402
from shardlang.launch.job import Job, run  # noqa: E402
from shardlang.verification.reference import K  # noqa: E402
from shardlang.verification.routing import Record, Replay, Routed, replay_under  # noqa: E402
from shardlang.verification.truth import Float64Kernels, run_forward_under  # noqa: E402

from .conftest import ROOT  # noqa: E402

ERNIE = "examples/families/ernie4_5_moe.py"
PLAN = ROOT / "tests/fixtures/families/ernie4_5_moe_ep_bf16.sl"
PLANTED = ROOT / "tests/fixtures/families/ernie4_5_moe_router_allreduced.sl"
ROUTERS = ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]


def _ernie():
    from examples.families.ernie4_5_moe import build_model

    torch.manual_seed(0)
    return build_model()


def _qwen2_moe():
    from examples.families.qwen2_moe import build_model

    torch.manual_seed(0)
    return build_model()


def _units(text: str, model, world: int = 2) -> list[FullyShard]:
    plan = shardlang.loads(text)
    linted = lint(plan, model, world)
    assert linted.ok, linted.diagnostics
    return [s for s in lower(plan, linted.resolution, world).steps if isinstance(s, FullyShard)]


def test_ernie_routers_get_float32_units_before_their_layers():
    steps = _units(PLAN.read_text(), _ernie())
    order = [s.module for s in steps]
    assert order == [ROUTERS[0], "model.layers.0", ROUTERS[1], "model.layers.1", ""], order
    router = dict(steps[0].kwargs)["mp_policy"]
    assert dict(router.kwargs) == {
        "param_dtype": shardlang.frontend.ir.DType("float32"),
        "reduce_dtype": shardlang.frontend.ir.DType("float32"),
        "cast_forward_inputs": False,
    }
    assert "_keep_in_fp32_modules_strict" in steps[0].why and "e_score_correction_bias" in steps[0].why
    assert dict(dict(steps[1].kwargs)["mp_policy"].kwargs)["param_dtype"].name == "bfloat16"


def test_no_float32_unit_without_a_dtype_that_rounds_them_or_a_model_that_asks():
    """float32 compute keeps them anyway; Qwen2-MoE keeps nothing in float32 (its router is bfloat16 in
    transformers too)."""
    fp32 = PLAN.read_text().replace("mixed_precision(param=bf16, reduce=fp32)", "mixed_precision(reduce=fp32)")
    assert [s.module for s in _units(fp32, _ernie()) if s.why] == []
    qwen = (
        "mesh world = auto[dp=auto]\nfully_shard on world.dp {\n    each model.layers.*\n"
        "    mixed_precision(param=bf16, reduce=fp32)\n}\n"
    )
    assert [s.module for s in _units(qwen, _qwen2_moe()) if s.why] == []


def test_a_float32_unit_inside_the_experts_divides_its_gradients_as_they_do():
    """Ergo (transformers 5.25) keeps each expert's norm scale in float32, inside the experts that
    expert_parallel gives a unit of their own over dp, whose gradients are divided by dp x ep (the ep ranks
    train on their own data): the norm's float32 unit divides alike. It divided by dp alone, and a correct
    plan's norm gradients came out ep times too large (apply failed; lint, on fake tensors, passed)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "ErgoConfig"):
        pytest.skip("transformers before 5.25 has no Ergo")
    from benchmarks import zoo

    with torch.device("meta"):
        model = zoo.build(zoo.family("ergo"))
    plan = init_plan(model, ep=2)
    units = {u.module: u for u in _units(plan, model, world=4) if isinstance(u.module, str)}
    norm, experts = units["model.layers.1.mlp.experts.post_expert_norm"], units["model.layers.1.mlp.experts"]
    assert experts.divide_by is not None and norm.divide_by == experts.divide_by
    assert "stays float32" in norm.why


def test_the_printed_program_says_why_the_router_is_float32():
    from shardlang.emit.python import compile_python

    text = compile_python(shardlang.load(PLAN), _ernie(), 2)
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if "get_submodule('model.layers.0.mlp.gate')" in line)
    assert "stays float32 inside a bfloat16 unit" in lines[at - 1]
    assert "param_dtype=torch.float32" in lines[at] and "cast_forward_inputs=False" in lines[at]
    layer = next(i for i, line in enumerate(lines) if "get_submodule('model.layers.0'))" in line)
    assert at < layer


def test_float32_units_follow_transformers_patterns():
    """`gate.weight` is the router's weight, not the shared expert's gate_proj."""
    model = _ernie()
    plan = shardlang.load(PLAN)
    kept = float32_units(plan, lint(plan, model, 2).resolution)
    assert [k.module for k in kept] == ROUTERS
    assert kept[0].params == (
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.gate.moe_statics.e_score_correction_bias",
    )


# --- the replayed routing -----------------------------------------------------------------------------------


def _routed(choose=None, joined: bool = False):
    """A bfloat16 ERNIE (the 'sharded run') routes a batch; a float64 truth and a bfloat16 'same' reference
    replay it (`choose` may change the recorded choices first). The replay's judgement, the choices
    recorded and the truth. The routers' weights are scaled up from the tiny init, so that experts' scores
    are far apart, as a trained router's are."""
    from examples.families.common import example_input

    model = _ernie()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(30)
    inputs = example_input(4, torch.Generator().manual_seed(1))
    sharded = copy.deepcopy(model).to(torch.bfloat16)
    record = Record()
    with record:
        sharded(inputs)
    choices = record.choices if choose is None else [choose(c) for c in record.choices]
    replay = Replay()
    truth, same = _references(model, replay)
    replay.start({0: Routed(choices)}, 0, joined=joined)
    for reference in (truth, same):
        reference(inputs).logits.float().sum().backward()
    return replay.judge(K), record.choices, truth


def _references(model, replay: Replay):
    """The truth (float64, grouped_mm by float64 matmuls, as reference.py builds it) and a bfloat16 copy,
    both replaying `replay`."""
    truth, same = copy.deepcopy(model).double(), copy.deepcopy(model).to(torch.bfloat16)
    run_forward_under(truth, Float64Kernels())
    replay_under(truth, replay, "truth")
    replay_under(same, replay, "same")
    return truth, same


def test_replayed_routing_of_a_bfloat16_run_passes_and_is_forced():
    judged, recorded, _ = _routed()
    assert len(recorded) == 2 and judged.tokens == 2 * recorded[0].shape[0]
    assert judged.wrong == 0 and judged.unmatched == 0, judged


def _others(chosen: torch.Tensor) -> torch.Tensor:
    """Each token's two experts of the four that were not chosen."""
    return torch.tensor([[e for e in range(4) if e not in row] for row in chosen.tolist()])


def test_a_router_that_routes_wrong_fails_naming_it():
    """Every token sent to its two lowest-scored experts: no rounding explains that."""
    judged, recorded, _ = _routed(_others)
    assert judged.wrong > 0 and judged.worst[0] in ROUTERS, judged
    assert re.search(
        r"token routings \(tokens x routers\) wrong, worst by model\.layers\.\d\.mlp\.gate: to experts",
        judged.failure(),
    )


def test_a_tie_within_rounding_is_replayed_not_failed():
    """Two experts scored alike (router rows equal up to a bfloat16 unit in the last place): the forced
    choice may be either; the truth takes the forced one and the judgement calls it rounding."""
    from examples.families.common import example_input

    model = _ernie()
    with torch.no_grad():
        gate = model.model.layers[0].mlp.gate.weight
        gate[1] = gate[0] * (1 + 2**-9)  # a tie within bfloat16's rounding
    inputs = example_input(4, torch.Generator().manual_seed(1))
    record = Record()
    with record:
        copy.deepcopy(model).to(torch.bfloat16)(inputs)
    first = record.choices[0]
    swapped = torch.where(first == 0, 1, torch.where(first == 1, 0, first))
    replay = Replay()
    truth, same = _references(model, replay)
    replay.start({0: Routed([swapped, *record.choices[1:]])}, 0)
    for reference in (truth, same):
        reference(inputs)
    judged = replay.judge(K)
    assert judged.flipped > 0 and judged.wrong == 0, judged
    assert torch.equal(replay.seen["truth", 0, 0].forced, swapped)


def test_a_choice_by_max_along_a_dim_is_replayed():
    """PhiMoE's sparsemixer picks each token's expert with `scores.max(dim=-1)`: a choice, recorded and
    replayed as topk's are (keepdim or not); a max of a whole tensor, or of two, is no choice."""
    from shardlang.verification.routing import Replay, choice

    class Router(torch.nn.Module):
        def forward(self, scores):
            first = scores.max(dim=-1)[1]
            _, second = torch.max(scores, -1, keepdim=True)
            return torch.max(scores), torch.max(scores, scores), first, second

    scores = torch.tensor([[1.0, 1.0 + 2**-30, 0.5], [0.2, 0.9, 0.1]], dtype=torch.float64)
    assert choice(torch.max, (scores,), {}) is None and choice(torch.max, (scores, scores), {}) is None
    record = Record()
    with record:
        Router()(scores.float())  # float32 rounds the tie: expert 0 for token 0
    assert [c.tolist() for c in record.choices] == [[[0], [1]], [[0], [1]]]
    forced = [torch.tensor([[1], [1]]), torch.tensor([[1], [1]])]  # the other run chose expert 1 for token 0
    replay, router = Replay(), Router()
    replay_under(router, replay, "truth")
    replay.start({0: Routed(forced)}, 0)
    _, _, first, second = router(scores)
    assert first.tolist() == [1, 1] and second.tolist() == [[1], [1]]
    same = Router()
    replay_under(same, replay, "same")
    same(scores.float())
    judged = replay.judge(K)
    assert judged.wrong == 0 and judged.unmatched == 0, judged


def _phimoe_recorded():
    """PhiMoE in training, and its bfloat16 copy (the 'sharded run') run forward and backward under Record:
    the model, its inputs, the copy and what the copy's routing recorded."""
    from examples.families.common import example_input
    from examples.families.phimoe import build_model

    torch.manual_seed(0)
    model = build_model().train()
    inputs = example_input(4, torch.Generator().manual_seed(1))
    sharded = copy.deepcopy(model).to(torch.bfloat16)
    record = Record(sharded)
    with record:
        sharded(inputs).logits.float().sum().backward()
    return model, inputs, sharded, record.routed()


def _phimoe_routed(replayed: str):
    """PhiMoE in training (its sparsemixer draws Gumbel noise and Heun's random mask, and masks by a
    threshold) run in bfloat16 as the 'sharded run', then a float64 truth and a bfloat16 'same' reference
    replaying `replayed`: "choices" alone (as before masks and draws were replayed) or "all". The judgement,
    and the truth's router gradients' largest error from the bfloat16 run's, relative."""
    model, inputs, sharded, routed = _phimoe_recorded()
    replay = Replay()
    truth, same = _references(model, replay)
    replay.start({0: routed if replayed == "all" else Routed(routed.choices)}, 0)
    for reference in (truth, same):
        reference(inputs).logits.float().sum().backward()
    errors = []
    for name in (f"model.layers.{i}.mlp.router.weight" for i in range(2)):
        mine = sharded.get_parameter(name).grad.double()
        errors.append(float((mine - truth.get_parameter(name).grad).norm() / mine.norm()))
    return replay.judge(K), routed, max(errors)


def test_a_routers_random_draws_and_threshold_masks_are_replayed():
    """PhiMoE's router gradient depends on its random draws (the references draw their own: float64's differ
    from bfloat16's from one state) and on its threshold masks: replayed with its choices, the truth's router
    gradients are the bfloat16 run's to bfloat16's rounding; with its choices alone one is not (here the
    truth's layer-1 router gradient is all zeros)."""
    judged, routed, error = _phimoe_routed("all")
    assert (
        routed.masks
        and routed.draws
        and {key[0] for key in routed.draws} == {f"model.layers.{i}.mlp.router" for i in range(2)}
    )
    assert judged.wrong == 0, judged
    assert error < 0.03, error
    _, _, error = _phimoe_routed("choices")
    assert error > 0.1, error


def test_a_mask_flipped_beyond_rounding_fails_naming_its_router():
    """A replayed comparison the truth makes otherwise by far more than rounding (every threshold mask
    inverted) is a wrong routing of that router, as a wrong choice is."""
    model, inputs, _, routed = _phimoe_recorded()
    replay = Replay()
    truth, same = _references(model, replay)
    inverted = {key: ~mask for key, mask in routed.masks.items()}
    replay.start({0: Routed(routed.choices, inverted, routed.draws)}, 0)
    for reference in (truth, same):
        reference(inputs)
    judged = replay.judge(K)
    assert judged.wrong > 0 and judged.worst[0] in {f"model.layers.{i}.mlp.router" for i in range(2)}, judged


def test_comparisons_and_draws_outside_a_choosing_module_are_not_recorded():
    """Only the modules that make a choice have their comparisons and draws replayed: an activation's `x > 0`
    or a dropout-like draw elsewhere is the references' own."""

    class Gate(torch.nn.Module):
        def forward(self, x):
            keep = torch.rand_like(x) > 0.5
            return x.topk(1, dim=-1).indices, keep

    class Elsewhere(torch.nn.Module):
        def forward(self, x):
            return (x > 0) & (torch.rand_like(x) > 0.5)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.other = Gate(), Elsewhere()

        def forward(self, x):
            return self.gate(x), self.other(x)

    net = Net()
    record = Record(net)
    with record:
        net(torch.randn(3, 4))
    routed = record.routed()
    assert list(routed.draws) == [("gate", 0)] and list(routed.masks) == [("gate", 1)], routed


def test_choices_of_a_sequence_split_over_context_ranks_join_back():
    """Under context parallelism each rank's router sees its head-tail part of every sequence, as rows of
    [batch x part] (or [batch, part, k], or DeepSeek's [tokens, groups, k]): joined in rank order, the
    choices are the whole sequence's, row for row."""
    from shardlang.runtime.context_layout import sequence_layout
    from shardlang.verification.routing import Sequence

    batch, length, k = 3, 16, 2
    whole = torch.arange(batch * length * k).reshape(batch, length, k)
    layout = sequence_layout("headtail", 2)
    parts = [layout.split(whole, 1, rank) for rank in range(2)]
    sequence = Sequence(layout, 0, batch)
    assert torch.equal(sequence.join(parts), whole)
    assert torch.equal(sequence.join([p.reshape(-1, k) for p in parts]), whole.reshape(-1, k))
    grouped = [p.reshape(-1, 1, k) for p in parts]
    assert torch.equal(sequence.join(grouped), whole.reshape(-1, 1, k))
    assert sequence.join([parts[0].reshape(-1, k)[:5], parts[1].reshape(-1, k)[:5]]) is None  # not its tokens
    assert sequence.join([parts[0], None]) is None


def test_choices_joined_out_of_order_are_not_replayed():
    """Choices joined from a sequence's parts that differ from the reference's own on most tokens are not
    these tokens' (a layout the join misread): not replayed, counted, and no router is blamed."""
    judged, recorded, _ = _routed(lambda c: c.roll(1, 0).flip(-1) if c.shape[0] > 1 else c, joined=True)
    assert judged.unmatched == len(recorded) and judged.wrong == 0, judged
    judged, _, _ = _routed(joined=True)  # joined right: replayed
    assert judged.unmatched == 0 and judged.wrong == 0, judged


# --- the plan, applied ------------------------------------------------------------------------------------


def _apply(pools, plan):
    job = Job(str(plan), {}, str(ROOT / ERNIE), None, shardlang.load(plan).checks)
    return pools(2).run(run, job)[0]


@pytest.mark.distributed
def test_ernie_tp_ep_bf16_passes_with_its_routers_in_float32(pools):
    report = _apply(pools, PLAN)
    (check,) = report.checks
    assert report.ok and check.status == "pass", check.message
    assert "2 modules kept in float32" in check.message


@pytest.mark.distributed
def test_ernie_under_context_parallelism_replays_its_routing(pools):
    """Each cp rank's routers see part of every sequence: the check joins their choices back and replays
    every topk call in the references (bfloat16 compute, where a near-tie flips)."""
    report = _apply(pools, ROOT / "tests/fixtures/families/ernie4_5_moe_cp_bf16.sl")
    (check,) = report.checks
    assert check.status == "pass", check.message
    assert "not replayed" not in check.message, check.message


@pytest.mark.distributed
def test_ernie_router_gradient_summed_over_tp_fails_naming_the_router(pools):
    """The router's float32 unit and the replayed routing do not hide a router gradient summed over tp: the
    check fails at both routers' weights, the worst of all its tensors, and the localising rerun names the
    first router, at its rule, by its weight's gradient (a backward-only fault: everything flowing through
    the model agrees). Not `model.layers.0.mlp.experts.act_fn`, as it did before: under expert_parallel a
    module inside the experts sees only the rows sent to its rank, which do not pair with the unsharded
    model's, and is not compared (localise.py)."""
    report = _apply(pools, PLANTED)
    (check,) = report.checks
    assert check.status == "fail", check.message
    assert re.search(r"worst [\d.]+ x the allowed error \(grad model\.layers\.\d\.mlp\.gate\.weight\)", check.message)
    failing = {re.search(r"gradient of (\S+):", f).group(1) for f in check.data["failures"] if "gradient of" in f}
    assert failing == {f"{router}.weight" for router in ROUTERS}, check.data["failures"]
    _assert_named(check, ROUTERS[0], "gradient of its parameter weight", PLANTED, "router_grad_summed")


def _assert_named(check, module: str, what: str, plan, style: str) -> None:
    """The check's localised finding names `module`, its `what`, at its own rule (`style`) in `plan`."""
    where = check.data["localised"]
    assert (where["module"], where["what"].split(" (")[0]) == (module, what), where
    rule = where["statements"][0]
    assert rule["what"] == "the parallelize rule on it" and rule["text"].endswith(f": {style}"), rule
    assert plan.read_text().splitlines()[rule["line"] - 1].strip() == rule["text"], rule


@pytest.mark.distributed
def test_ernie_experts_combined_without_their_weights_are_named_at_the_experts(pools):
    """A fault in the split experts' own forward (their combine forgets the routing weights): the first
    disagreement is the experts module's output, named at its rule, and not a module inside it (the
    `act_fn` of the rows sent to its rank, as before)."""
    plan = ROOT / "tests/fixtures/families/ernie4_5_moe_experts_unweighted.sl"
    (check,) = _apply(pools, plan).checks
    assert check.status == "fail", check.message
    _assert_named(check, "model.layers.0.mlp.experts", "output", plan, "experts_unweighted")


@pytest.mark.distributed
def test_mixtral_ep_router_gradient_summed_over_ep_is_named_at_the_router(pools):
    """plans/hf/mixtral_ep.sl (which passes: tests/test_apply_cli.py) with its router's gradient summed over
    ep: named at the router's weight, not at the split experts' `act_fn`."""
    plan = ROOT / "tests/fixtures/families/mixtral_ep_router_allreduced.sl"
    job = Job(str(plan), {}, str(ROOT / "examples/field/mixtral.py"), None, shardlang.load(plan).checks)
    (check,) = pools(2).run(run, job)[0].checks
    assert check.status == "fail", check.message
    _assert_named(
        check, "model.layers.0.mlp.gate", "gradient of its parameter weight", plan, "replicated_with_grad_allreduce"
    )


def test_a_tie_routed_otherwise_moves_gradients_far_beyond_rounding_unless_replayed():
    """Layer 0's experts 0 and 1 scored alike within bfloat16's rounding: the bfloat16 run routes some tokens
    to the other one than the float64 truth does, and the truth's gradients of that layer's experts and router
    are 20-30% away from the bfloat16 run's (what failed ERNIE on 2 x H200); replaying the bfloat16 run's
    routing brings them to bfloat16's rounding (under 1%)."""
    from examples.families.common import example_input

    model = _ernie()
    with torch.no_grad():
        gate = model.model.layers[0].mlp.gate.weight
        gate[1] = gate[0] * (1 + 2**-9)
    inputs = example_input(4, torch.Generator().manual_seed(1))
    sharded = copy.deepcopy(model).to(torch.bfloat16)
    record = Record()
    with record:
        sharded(inputs).logits.float().sum().backward()
    errors = {}
    for replayed in (False, True):
        replay = Replay()
        truth, _ = _references(model, replay)
        if replayed:
            replay.start({0: Routed(record.choices)}, 0)
        truth(inputs).logits.float().sum().backward()
        for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.gate.weight"):
            want = truth.get_parameter(name).grad
            errors[replayed, name] = float((sharded.get_parameter(name).grad.double() - want).norm() / want.norm())
    assert all(errors[False, name] > 0.1 for _, name in errors), errors
    assert all(errors[True, name] < 0.03 for _, name in errors), errors


def dtypes_in_forward(plan_text: str) -> dict[str, dict[str, str]]:
    """Run on every rank: ERNIE under the plan, applied by shardlang and by its printed program, one forward
    each; the dtype the router's and an attention projection's weights had while they ran."""
    from examples.families.common import example_input
    from examples.families.ernie4_5_moe import build_model

    from .dist_jobs import applied_both_ways

    applied, printed = applied_both_ways(plan_text, build_model, 2)
    found = {}
    for how, model in (("apply", applied), ("printed", printed)):
        seen = found.setdefault(how, {})
        for name in ("model.layers.0.mlp.gate", "model.layers.0.self_attn.o_proj"):
            model.get_submodule(name).register_forward_pre_hook(_note_dtype(seen, name))
        model(example_input(2, torch.Generator().manual_seed(0)))
    return found


def _note_dtype(seen: dict, name: str):
    def hook(module, args) -> None:
        seen[name] = str(module.weight.dtype)

    return hook


@pytest.mark.distributed
def test_the_router_computes_in_float32_applied_and_printed(pools):
    found = pools(2).run(dtypes_in_forward, PLAN.read_text())[0]
    want = {"model.layers.0.mlp.gate": "torch.float32", "model.layers.0.self_attn.o_proj": "torch.bfloat16"}
    assert found == {"apply": want, "printed": want}, found
