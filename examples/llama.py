"""A small Llama-style transformer: token embeddings, blocks of RMSNorm + attention (rotary
embeddings) and RMSNorm + SwiGLU feed-forward, a final norm and an output projection.

Names follow torchtitan's Llama, so the plans in plans/ read like the ones people write for it.
The sizes are small so that it trains on CPU in the tests; every weight dim divides by 2 and 4.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, LAYERS, HIDDEN, SEQ = 64, 32, 4, 2, 64, 8


def rotary_table(head_dim: int, seq: int, theta: float = 10000.0) -> torch.Tensor:
    """cos and sin of the rotary angles, (seq, head_dim): first half cos, second half sin."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of features of x (batch, seq, heads, head_dim) by the table's angles."""
    half = x.shape[-1] // 2
    cos, sin = table[: x.shape[1], :half], table[: x.shape[1], half:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds its own share of the heads.
        q = apply_rotary(self.wq(x).view(batch, seq, -1, self.head_dim), rope)
        k = apply_rotary(self.wk(x).view(batch, seq, -1, self.head_dim), rope)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=1e-6)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-6)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab=VOCAB, dim=DIM, heads=HEADS, layers=LAYERS, hidden=HIDDEN, seq=SEQ):
        super().__init__()
        self.head_dim, self.seq = dim // heads, seq
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("rope", rotary_table(self.head_dim, seq), persistent=False)

    def reset_parameters(self) -> None:
        """Recompute the rotary table (a model built on the meta device has none)."""
        self.rope = rotary_table(self.head_dim, self.seq).to(self.rope.device)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids` (batch, seq), the same for every sequence: where the tokens stand in their
        sequence, when they are not 0, 1, 2, ... (a context-parallel rank's shard of it)."""
        h = self.tok_embeddings(tokens)
        rope = self.rope if position_ids is None else self.rope[position_ids[0]]
        for layer in self.layers:
            h = layer(h, rope)
        return self.output(self.norm(h))


def build_model() -> nn.Module:
    return Transformer()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator)


#: cross_entropy's default ignore_index: the label of a position that is trained on nothing.
IGNORE = -100


def shifted_labels(tokens: torch.Tensor) -> torch.Tensor:
    """Next-token labels: position t is trained on token t + 1, the last position on nothing."""
    labels = tokens.roll(-1, dims=1)
    labels[:, -1] = IGNORE
    return labels


def causal_lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy. The labels are shifted, not the logits: `logits[:, :-1]` would copy the
    whole [batch, seq, vocab] tensor, the step's largest activation (3% of a 1B model's step on H200s).
    Under `loss_parallel` the logits arrive sharded over the vocabulary as a DTensor, and torch computes
    this without gathering them."""
    return F.cross_entropy(logits.flatten(0, 1).float(), shifted_labels(tokens).flatten(), ignore_index=IGNORE)


loss = causal_lm_loss


def build_large() -> nn.Module:
    """The same structure at the scale of a 70B-parameter model (80 layers, dim 8192), for
    `shardlang explain --entry examples.llama:build_large` on the meta device."""
    return Transformer(vocab=128256, dim=8192, heads=64, layers=80, hidden=28672, seq=8192)
