"""A small block with every layout transformers' models bring that torch's own TP styles cannot express
(plans/transformers_styles.sl gives each its built-in style; no transformers needed):

- `mlp.gate_up`: one nn.Linear computing [gate; up] (with a bias), split again by `chunk(2, -1)`;
- `attn.qk` and `attn.out`: a projection to 8 heads of 16, each normalised on its own by a per-head
  RMSNorm (`attn.head_norm`, weight [16]) as Qwen3's and Gemma 3's q/k norms are;
- `ffn.fc` and `ffn.proj`: transformers' Conv1D layout, weight stored [in, out], computing x @ W + b;
- `head.gather` and `head.split`: a pair whose middle activations stay whole on every rank.

Width 128 (8 heads of 16), sequences of 8; float32. The width divides by the data-parallel size of
`explain --world 1024 -D tp=8` (128), which FSDP2 needs of a packed weight's columns.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, SEQ = 128, 8, 8


class Conv1D(nn.Module):
    """transformers' Conv1D (GPT-2): a linear layer whose weight is stored [in, out]."""

    def __init__(self, nx: int, nf: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.empty(nf))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.2)
        nn.init.normal_(self.bias, std=0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size)


class HeadNorm(nn.Module):
    """RMSNorm over the last dim of (batch, seq, heads, head_dim): one weight shared by every head."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=1.0, std=0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class PackedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class HeadAttention(nn.Module):
    """Not attention: the shape of its first half (heads, each normalised with a shared weight)."""

    def __init__(self):
        super().__init__()
        self.qk = nn.Linear(DIM, DIM, bias=False)
        self.head_norm = HeadNorm(DIM // HEADS)
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.qk(x)
        q = self.head_norm(q.view(*q.shape[:-1], -1, DIM // HEADS)).flatten(-2)
        return self.out(q)


class Conv1DMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = Conv1D(DIM, 2 * DIM)
        self.proj = Conv1D(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class GatherSplit(nn.Module):
    def __init__(self):
        super().__init__()
        self.gather = nn.Linear(DIM, 2 * DIM)
        self.split = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.split(torch.tanh(self.gather(x)))


class Fused(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = PackedMLP()
        self.attn = HeadAttention()
        self.ffn = Conv1DMLP()
        self.head = GatherSplit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mlp(x)
        x = x + self.attn(x)
        x = x + self.ffn(x)
        return self.head(x)


def build_model() -> nn.Module:
    return Fused()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, SEQ, DIM, generator=generator)


def loss(output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return (output - inputs.flip(-1)).pow(2).mean()
