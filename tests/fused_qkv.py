"""A fused QKV projection whose state dict holds it split (as torchtitan's FusedQKVLinear): a post-hook saves
`wqkv.weight`/`.bias` as `wq`, `wk`, `wv`, and a load pre-hook merges them back. Rows are grouped by head
([q, k, v] of head 0, then of head 1), so `colwise` on `attention.wqkv` gives each TP rank whole heads."""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

DIM, HEADS = 16, 2
HEAD_DIM = DIM // HEADS


class FusedQKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.wqkv = nn.Linear(DIM, 3 * DIM)
        self.register_state_dict_post_hook(_split_on_save)
        self.register_load_state_dict_pre_hook(_merge_on_load)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.wqkv(x).view(*x.shape[:-1], -1, 3, HEAD_DIM)  # -1: the heads this TP rank holds
        q, k, v = qkv.unbind(-2)
        return (q * torch.sigmoid(k) + v).flatten(-2)


def _split_on_save(module, state_dict, prefix, local_metadata) -> None:
    for param in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}wqkv.{param}")
        if isinstance(fused, DTensor):  # whole on every rank, so the split is local
            fused = fused.redistribute(fused.device_mesh, [Replicate()] * fused.device_mesh.ndim)
        grouped = fused.reshape(HEADS, 3, HEAD_DIM, *fused.shape[1:])
        for i, name in enumerate(("wq", "wk", "wv")):
            state_dict[f"{prefix}{name}.{param}"] = grouped[:, i].reshape(DIM, *fused.shape[1:]).contiguous()


def _merge_on_load(module, state_dict, prefix, *args) -> None:
    for param in ("weight", "bias"):
        keys = [f"{prefix}{name}.{param}" for name in ("wq", "wk", "wv")]
        if all(key in state_dict for key in keys):
            parts = [state_dict.pop(key) for key in keys]
            if isinstance(parts[0], DTensor):
                parts = [p.redistribute(p.device_mesh, [Replicate()] * p.device_mesh.ndim) for p in parts]
            grouped = torch.stack([p.reshape(HEADS, HEAD_DIM, *p.shape[1:]) for p in parts], dim=1)
            state_dict[f"{prefix}wqkv.{param}"] = grouped.reshape(3 * DIM, *parts[0].shape[1:])


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = FusedQKV()
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.attention(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model() -> nn.Module:
    return Net()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, DIM, generator=generator)
