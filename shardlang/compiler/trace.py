"""The order a model's modules run in: one forward pass (on the meta device; for a small model that cannot
run there, on the CPU) from the model file's example input, each module's forward-pre hook recording its
first call. Declaration order (`named_modules()`) is
not execution order: torchtitan's TransformerBlock declares `feed_forward` before `ffn_norm`, which runs
first; lint rules that follow activations through a model need the order they really flow in.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from attrs import frozen

#: The batch of the traced forward (meta tensors: its size costs nothing).
BATCH = 2


@frozen
class Order:
    """Module FQNs in the order their forward first ran (`modules`), or None with `why` it is not known.
    `skipped`: modules that ran in an eval-mode forward but not in the traced (training) one: skipped at
    random in training (LayerDrop, stochastic depth), by the traced draw."""

    modules: tuple[str, ...] | None
    why: str = ""
    skipped: tuple[str, ...] = ()

    @property
    def traced(self) -> bool:
        return self.modules is not None


def trace_order(model: nn.Module, example_input: Callable[[int, torch.Generator], Any] | None) -> Order:
    """Run a copy of `model` once on `example_input(2, g)`, recording module forward-pre hooks in call
    order: on the meta device, or, for a small model whose forward cannot run on meta (a data-dependent
    op: a mixture of experts' routing), on the CPU with random values. Order(None, why) when neither runs."""
    if example_input is None:
        return Order(None, "the model file defines no example_input")
    try:
        return _traced(model, example_input, "meta")
    except Exception as e:  # noqa: BLE001 - any failure of user code means: order unknown, say why
        failure = _describe(e)
    size = sum(t.numel() for t in [*model.parameters(), *model.buffers()])
    if size > CPU_LIMIT:
        return Order(None, f"its forward on the meta device failed ({failure})")
    try:
        return _traced(model, example_input, "cpu")
    except Exception as e:  # noqa: BLE001
        return Order(None, f"its forward failed on the meta device ({failure}) and on the CPU ({_describe(e)})")


def _traced(model: nn.Module, example_input: Callable, device: str) -> Order:
    """The order on `device`, the random draws of the model's forward made from one seed (the same order
    every time); where the model trains and some blocks of a stack did not run, the modules an eval-mode
    forward runs besides (`skipped`: blocks LayerDrop skipped by the draw)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        modules = _run(model, example_input, device)
    if not model.training or not _partly_ran(model, set(modules)):
        return Order(modules)
    try:
        evaluated = _run(model, example_input, device, training=False)
    except Exception:  # noqa: BLE001 - a forward that runs only in training: nothing more to learn
        return Order(modules)
    ran = set(modules)
    return Order(modules, skipped=tuple(m for m in evaluated if m not in ran))


#: The most parameter and buffer elements a model may hold to be traced on the CPU (1 GiB in float32).
CPU_LIMIT = 2**28


def _run(model: nn.Module, example_input: Callable, device: str, training: bool | None = None) -> tuple[str, ...]:
    inputs = example_input(BATCH, torch.Generator().manual_seed(0))
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    copy_ = random_copy(model, device)
    if training is not None:
        copy_.train(training)
    seen: dict[str, None] = {}
    hooks = [
        module.register_forward_pre_hook(lambda _m, _a, name=name: seen.setdefault(name))
        for name, module in copy_.named_modules()
    ]
    try:
        with torch.no_grad():
            copy_(*(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs))
    finally:
        for hook in hooks:
            hook.remove()
    return tuple(seen)


def _partly_ran(model: nn.Module, ran: set[str]) -> bool:
    """Whether some container of blocks (ModuleList, Sequential, ModuleDict) had some children run and others
    not."""
    for fqn, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            children = [f"{fqn}.{name}" if fqn else name for name in module._modules]
            if len({child in ran for child in children}) == 2:
                return True
    return False


def random_copy(model: nn.Module, device: str) -> nn.Module:
    """A copy of `model` (which may be on meta) on `device`: on meta as it is, elsewhere with random values
    (floating tensors drawn from N(0, 0.02) under a fixed seed, the others zero)."""
    with torch.device("meta"):
        copy_ = copy.deepcopy(model).to("meta")
    if device == "meta":
        return copy_
    copy_ = copy_.to_empty(device=device)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in [*copy_.parameters(), *copy_.buffers()]:
            if tensor.is_floating_point():
                tensor.normal_(0, 0.02, generator=generator)
            else:
                tensor.zero_()
    return copy_


def _describe(error: Exception) -> str:
    first = str(error).splitlines()[0] if str(error).strip() else "(no message)"
    return f"{type(error).__name__}: {first[:160]}"
