"""User styles with planted faults, and their fixed twins (tests/test_faults.py)."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

from examples.styles import ColwiseConv1D


def colwise_off_on_rank1(module, mesh):
    """Column-wise, but rank 1's output is 1% too large: a forward that is wrong on one rank."""
    parallelize_module(module, mesh, ColwiseParallel())
    if dist.get_rank() == 1:
        module.register_forward_hook(lambda mod, args, out: out * 1.01)


def colwise(module, mesh):
    """The fixed twin of colwise_off_on_rank1."""
    parallelize_module(module, mesh, ColwiseParallel())


def colwise_bias_on_meta(module, mesh):
    """Column-wise, then a bias re-created on the meta device: a parameter left unmaterialised."""
    parallelize_module(module, mesh, ColwiseParallel())
    module.bias = nn.Parameter(torch.empty(module.bias.shape, device="meta"))


def _colwise_from_local(module, mesh, plain_bias_on_rank=None):
    """Column-wise by hand, each rank wrapping its own rows (DTensor.from_local: no collective), the bias
    left a plain tensor on global rank `plain_bias_on_rank`."""
    from torch.distributed.tensor import DTensor

    for name in ("weight", "bias"):
        if name == "bias" and dist.get_rank() == plain_bias_on_rank:
            continue
        param = getattr(module, name)
        rows = param.detach().chunk(mesh.size(), dim=0)[mesh.get_local_rank()].clone()
        setattr(module, name, nn.Parameter(DTensor.from_local(rows, mesh, [Shard(0)], run_check=False)))


def colwise_bias_plain_on_rank1(module, mesh):
    """Column-wise, but rank 1 keeps its whole bias as a plain tensor (a branch meant for one rank that
    wraps too much): the ranks disagree about the layout of one parameter."""
    _colwise_from_local(module, mesh, plain_bias_on_rank=1)


def colwise_from_local(module, mesh):
    """The fixed twin of colwise_bias_plain_on_rank1."""
    _colwise_from_local(module, mesh)


def colwise_reading_values(module, mesh):
    """Column-wise only if the weight has no zero row: it reads the values, which a meta copy has none of."""
    if bool((module.weight == 0).all(dim=1).any()):
        raise ValueError("a zero row")
    parallelize_module(module, mesh, ColwiseParallel())


class ShardingSequenceParallel(SequenceParallel):
    """Subclasses sequence parallel (parameters replicated) but shards them on dim 0: predicted as what
    it does, not as its base class (tests/test_predict.py)."""

    def _replicate_module_fn(self, name, module, device_mesh):
        for p_name, param in module.named_parameters():
            module.register_parameter(p_name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)])))


class PlainSequenceParallel(SequenceParallel):
    """A subclass that keeps SequenceParallel's replication."""


# --- faults users shipped (issue: verdicts) ---------------------------------------------------------


def _rowwise_by_hand(module, mesh, *, bias_before_reduce: bool, reduce: bool = True):
    """Row-wise parallel written by hand: the weight split over its input features, each rank's partial
    product summed over the TP group (or not), the bias added before or after that sum."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Shard(1)]))
    bias = nn.Parameter(distribute_tensor(module.bias.detach(), mesh, [Replicate()]))
    module.weight, module.bias = weight, bias

    def forward(x):  # x: this rank's slice of the features (a colwise layer's local output)
        partial = torch.nn.functional.linear(x, weight.to_local(), bias.to_local() if bias_before_reduce else None)
        if reduce:
            partial = DTensor.from_local(partial, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()
        return partial if bias_before_reduce else partial + bias.to_local()

    module.forward = forward


def rowwise_bias_every_rank(module, mesh):
    """Fault: the bias is added on every TP rank before the partial sums are reduced (counted tp times)."""
    _rowwise_by_hand(module, mesh, bias_before_reduce=True)


def rowwise_bias_once(module, mesh):
    """The fixed twin: the bias is added once, after the reduction."""
    _rowwise_by_hand(module, mesh, bias_before_reduce=False)


def rowwise_no_reduce(module, mesh):
    """Fault: a style that forgets to redistribute its output: each rank returns its partial sum."""
    _rowwise_by_hand(module, mesh, bias_before_reduce=False, reduce=False)


def colwise_heads_swapped(module, mesh, head_dim: int = 8):
    """Fault: column-wise over attention heads, but heads 1 and 2 trade places, so one head's rows sit on
    the wrong rank (rank 0 holds heads 0 and 2, rank 1 heads 1 and 3)."""
    with torch.no_grad():
        w = module.weight
        rows = torch.arange(w.shape[0])
        rows[head_dim : 2 * head_dim], rows[2 * head_dim : 3 * head_dim] = (
            torch.arange(2 * head_dim, 3 * head_dim),
            torch.arange(head_dim, 2 * head_dim),
        )
        w.copy_(w[rows].clone())
    parallelize_module(module, mesh, ColwiseParallel())


def colwise_head0_frozen(module, mesh, head_dim: int = 4):
    """Fault: column-wise, but on TP rank 0 the first head's rows get no gradient (their output is
    computed from a detached copy of them): one head of eight silently never trains. Every rank runs the
    same operations (only rank 0 detaches), so the collectives of backward stay the same on every rank."""
    from torch.distributed.tensor import DTensor

    parallelize_module(module, mesh, ColwiseParallel())
    frozen = mesh.get_local_rank() == 0

    def hook(mod, args, out):
        x = args[0].to_local() if isinstance(args[0], DTensor) else args[0]
        w = mod.weight.to_local() if isinstance(mod.weight, DTensor) else mod.weight
        rows = w[:head_dim].detach() if frozen else w[:head_dim]
        return torch.cat([torch.nn.functional.linear(x, rows), out[..., head_dim:]], dim=-1)

    module.register_forward_hook(hook)


def colwise_drops_last_rows(module, mesh):
    """Fault: an uneven column-wise shard that gives every rank out_features // tp rows, dropping the
    remainder (the last rows), and claims the usual Shard(0) layout."""
    from torch.distributed.tensor import DTensor

    n, tp, rank = module.weight.shape[0], mesh.size(), mesh.get_local_rank()
    rows = n // tp
    local = module.weight.detach()[rank * rows : (rank + 1) * rows].clone()
    module.weight = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
    if module.bias is not None:
        bias = module.bias.detach()[rank * rows : (rank + 1) * rows].clone()
        module.bias = nn.Parameter(DTensor.from_local(bias, mesh, [Shard(0)], run_check=False))

    def forward(x):
        out = torch.nn.functional.linear(x, module.weight.to_local(), module.bias.to_local())
        return DTensor.from_local(out, mesh, [Shard(-1)]).full_tensor()

    module.forward = forward


class _ReduceBackward(torch.autograd.Function):
    """Identity forward; the gradient summed over `group` in backward, then divided by `divide` (Megatron's
    copy-to-tensor-parallel-region)."""

    @staticmethod
    def forward(ctx, x, group, divide):
        ctx.group, ctx.divide = group, divide
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad / ctx.divide, None, None


class ColwiseReducingInHook(torch.distributed.tensor.parallel.ParallelStyle):
    """Column-wise parallel written as Megatron-LM writes it: the weight's rows sharded, a local output,
    and the input's gradient (a partial sum on each rank) all-reduced in backward by an autograd function
    a forward pre-hook wraps the input in. `average`: the fault of averaging it as data parallelism
    averages gradients, where tensor parallelism must sum."""

    def __init__(self, average: bool = False):
        super().__init__()
        self.average = average

    def _apply(self, module, device_mesh):
        weight = nn.Parameter(distribute_tensor(module.weight.detach(), device_mesh, [Shard(0)]))
        bias = nn.Parameter(distribute_tensor(module.bias.detach(), device_mesh, [Shard(0)]))
        module.weight, module.bias = weight, bias
        group, divide = device_mesh.get_group(), device_mesh.size() if self.average else 1
        module.register_forward_pre_hook(lambda mod, args: (_ReduceBackward.apply(args[0], group, divide),))
        module.forward = lambda x: torch.nn.functional.linear(x, weight.to_local(), bias.to_local())
        return module


class ColwiseAveragingInHook(ColwiseReducingInHook):
    """Fault: ColwiseReducingInHook averaging the input's gradient over the TP group instead of summing it."""

    def __init__(self):
        super().__init__(average=True)


class ColwiseConv1DBiasPlainOnRank1(ColwiseConv1D):
    """examples.styles.ColwiseConv1D (GPT-2's Conv1D), but global rank 1 then keeps its bias shard as a
    plain tensor (a branch meant for one rank that unwraps too much; no collective follows, so nothing
    waits on it): the ranks disagree about the layout of one parameter."""

    def _apply(self, module, device_mesh):
        module = super()._apply(module, device_mesh)
        if dist.get_rank() == 1:
            module.bias = nn.Parameter(module.bias.to_local())
        return module


class _HalfGradient(torch.autograd.Function):
    """The identity forward; its backward hands back half of the features' gradient: the wrong shape."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., : grad.shape[-1] // 2]


def colwise_backward_raises(module, mesh):
    """Column-wise, its forward wrapped in a function whose backward returns a gradient of the wrong shape:
    the step fails in this module's backward, which no traceback frame of the module shows."""
    parallelize_module(module, mesh, ColwiseParallel())
    forward = module.forward
    module.forward = lambda x: _HalfGradient.apply(forward(x))
