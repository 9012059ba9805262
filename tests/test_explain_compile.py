"""explain's model of `compile`: the compiled modules and loss traced by AOTAutograd with inductor's
decompositions and partitioner, their non-library ops fused (shardlang/explain/compiled.py), on fake
tensors inside the simulated step."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardlang

pytestmark = pytest.mark.distributed  # explain simulates its world in a fake process group


class Wavy(nn.Module):
    """A Linear, then a chain of pointwise ops whose eager backward saves every intermediate; compiled,
    the partitioner saves the Linear's output and recomputes the chain in the backward."""

    def __init__(self, dim: int = 256):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.lin(x)
        for _ in range(4):
            h = torch.sin(h) * 1.5 + torch.cos(h)
        return h


class Net(nn.Module):
    def __init__(self, dim: int = 256, vocab: int = 4096):
        super().__init__()
        self.blocks = nn.ModuleList(Wavy(dim) for _ in range(2))
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def example_input(batch_size, generator):
    return torch.randn(batch_size, 64, 256, generator=generator)


def loss(output, inputs):
    """A cross-entropy over a wide output, upcast first, as language models compute it."""
    logits = output.float().flatten(0, 1)
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long))


def _explain(statements: str):
    plan = shardlang.loads(f"mesh world = cpu[dp=auto]\nfully_shard on world.dp {{ each blocks.* }}\n{statements}")
    with torch.device("meta"):
        model = Net()
    return plan.explain(model, 2, example_input=example_input, loss=loss, batch=8, gpu="h100")


@pytest.fixture(scope="module")
def eager():
    return _explain("")


def _block(explained) -> int:
    """The activations a block holds at the peak (its own and its Linear's)."""
    return sum(n for name, n in explained.peak.modules if name.startswith("blocks.0"))


def _kernels(explained) -> int:
    return explained.time.kernels


def test_compiled_blocks_save_less_and_launch_fewer_kernels(eager):
    compiled = _explain("compile blocks.*")
    assert any(n.startswith("compile modelled as inductor runs it") for n in compiled.notes), compiled.notes
    assert not any("compile is not modelled" in n for n in compiled.notes)
    # The chain's intermediates: a saved tensor per step of it eagerly, recomputed when compiled.
    assert _block(compiled) < _block(eager) / 2, (compiled.peak.modules, eager.peak.modules)
    assert _kernels(compiled) < _kernels(eager) - 20
    assert compiled.time.compute < eager.time.compute
    # What is not compiled is not changed: the collectives are the same.
    assert compiled.collectives == eager.collectives


def test_a_compiled_loss_never_holds_the_upcast_logits(eager):
    """Eagerly the float logits and their log-softmax are live at the loss; the compiled loss keeps
    neither (what stays is the fused kernel's output, the bf16-sized logits' gradient)."""
    compiled = _explain("compile loss")
    logits = 8 * 64 * 4096 * 4
    assert eager.peak.bytes - compiled.peak.bytes >= logits, (eager.peak.bytes, compiled.peak.bytes)
    assert _kernels(compiled) < _kernels(eager)


def test_what_cannot_be_modelled_runs_eager_and_says_which_statement():
    plan = shardlang.loads("mesh world = cpu[dp=auto]\ncompile blocks.*\nfully_shard on world.dp { each blocks.* }")
    with torch.device("meta"):
        model = Net()
    model.blocks[0].lin.register_forward_hook(lambda *_: None)
    explained = plan.explain(model, 2, example_input=example_input, loss=loss, batch=8)
    assert "not modelled for `compile blocks.*` (line 2): lin inside it has hooks of its own; stepped eager" in (
        explained.notes
    )


def test_a_checkpointed_compiled_block_runs_its_compiled_forward_again_in_the_backward(eager):
    """Compiled blocks under activation checkpointing ran eager in explain (so the 1B's 'ac every other,
    compiled' was predicted 169.3 ms where one H200 measured 155.6; 157.4 now): the compiled forward runs
    again in the backward, counted as recomputation, and the block keeps only its input."""
    compiled = _explain("compile blocks.*")
    both = _explain("checkpoint blocks.*\ncompile blocks.*")
    assert not any("stepped eager" in n for n in both.notes), both.notes
    assert both.time.flops > both.time.model_flops == compiled.time.model_flops  # the forward, again
    assert _block(both) < _block(compiled)
    assert both.time.compute < _explain("checkpoint blocks.*").time.compute  # and fused, as compiled


@torch.library.custom_op("shardlang_tests::rows_summed", mutates_args=())
def rows_summed(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """torchtitan's MoE sums its experts' rows back onto their tokens through a custom op like this one
    (`deterministic_scatter_add`), which inductor has no lowering for: a library call."""
    raise AssertionError("explain ran the op's real kernel, on tensors it made outside its fake mode")


@rows_summed.register_fake
def _(out, index, src):
    return torch.empty_like(out)


def _rows_summed_backward(ctx, grad):
    return grad, None, grad.gather(0, ctx.index)


def _keep_index(ctx, inputs, output):
    ctx.index = inputs[1]


rows_summed.register_autograd(_rows_summed_backward, setup_context=_keep_index)


class Paired(nn.Module):
    """Sums each pair of rows through `rows_summed`, whose every input the block makes itself (zeros, an
    arange, a product): fused values, each allocated where the library call reads it."""

    def __init__(self, dim: int = 256):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.lin(x).flatten(0, 1)
        n, d = h.shape
        index = (torch.arange(n, device=h.device) // 2).unsqueeze(1).expand(n, d)
        out = rows_summed(torch.zeros(n // 2, d, dtype=h.dtype, device=h.device), index, h * 2)
        return out.repeat_interleave(2, 0).view_as(x)


def test_a_compiled_block_is_traced_on_fake_tensors_only():
    """AOTAutograd's first call traced outside the step's modes, and a value the block made (an `empty`, an
    arange) came out real: on torchtitan's MoE, garbage token positions sent its scatter-add to the real
    kernel, which read out of bounds, and every compiled MoE candidate of `shardlang search` was 'not
    predicted'. Now the first call keeps the fake mode."""
    plan = shardlang.loads("mesh world = cpu[dp=auto]\nfully_shard on world.dp { each blocks.* }\ncompile blocks.*")
    with torch.device("meta"):
        model = Net()
        model.blocks = nn.ModuleList(Paired() for _ in range(2))
    explained = plan.explain(model, 2, example_input=example_input, loss=loss, batch=8, gpu="h100")
    assert any(n.startswith("compile modelled as inductor runs it") for n in explained.notes), explained.notes
    assert explained.time is not None and explained.time.compute > 0
