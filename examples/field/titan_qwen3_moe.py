"""torchtitan 0.3.0's own Qwen3-MoE (not transformers'), built from its config classes at a small size
(issue 27, on issue 23's field bed): no weights, no network, no trainer. Needs the optional extra:
pip install -e '.[titan]'.

2 layers, dim 64, 4 heads of 16 over 2 key/value heads with q and k norms, and in every layer a mixture
of 8 experts of width 32, top 2, softmax routing normalised over the chosen experts, as
`_build_qwen3_moe_layers` configures Qwen3-MoE. vocab 128, float32. The layout of its experts is
torchtitan's, not transformers': `moe.router.gate` scores the experts, `moe.routed_experts` holds a
token dispatcher (it sorts each layer's (token, choice) pairs by expert, and afterwards weights the
results and sums them into their tokens) and `moe.routed_experts.inner_experts`, the grouped experts,
whose forward takes the rows already grouped by expert and each expert's count
(`forward(x [rows, 64], num_tokens_per_expert [8])`, `torch._grouped_mm` in bf16) on weights stacked by
expert (`w1_EFD`, `w3_EFD` [8, 32, 64], `w2_EDF` [8, 64, 32]). Each MoE block also keeps two buffers
for its auxiliary-loss-free load balancing: `expert_bias_E` (persistent, updated by torchtitan's
optimizer hook, which this model file does not install) and `tokens_per_expert_E`, each rank's own count
of its tokens per expert.

torchtitan's imports need the stand-ins examples/field/titan_llama3.py installs on a CPU machine and
under torch 2.11 (see its docstring), and its attention the same SDPA module (`sdpa`).

`build_model` returns the model initialised as torchtitan's trainer initialises it (`init_states`).
"""

import warnings

import torch

from examples.field.common import SEQ, VOCAB, causal_lm_loss, example_input  # noqa: F401
from examples.field.titan_llama3 import sdpa  # (first: torchtitan's stand-ins)

# isort: split
import torchtitan.models.qwen3 as qwen3  # noqa: E402
from torchtitan.models.common import CosSinRoPE, Embedding, Linear  # noqa: E402

# torchtitan's router scores the experts under autocast to float32, which CPU autocast does not take (it
# warns at every forward and runs in the parameters' dtype, float32 here: the same numbers).
warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")

DIM, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, EXPERT_WIDTH, TOP_K = 64, 4, 2, 16, 8, 32, 2


def config(
    *,
    layers: int = 2,
    dim: int = DIM,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    head_dim: int = HEAD_DIM,
    experts: int = EXPERTS,
    expert_width: int = EXPERT_WIDTH,
    top_k: int = TOP_K,
    vocab: int = VOCAB,
    seq: int = SEQ,
) -> qwen3.Qwen3Model.Config:
    """torchtitan's Qwen3-MoE config at these sizes (its `_debugmodel_moe` shape, smaller), with torchtitan's
    own SDPA attention; benchmarks/titan_moe.py builds its 1.2B from the same function."""
    blocks = qwen3._build_qwen3_moe_layers(
        fuse_qkv=True,
        n_layers=layers,
        dim=dim,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        moe_hidden_dim=expert_width,
        num_experts=experts,
        top_k=top_k,
        attn_backend="flex",  # replaced by sdpa() below: only its name is read here
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=seq, theta=1000000.0),
        moe_comm_backend="standard",
    )
    return sdpa(
        qwen3.Qwen3Model.Config(
            vocab_size=vocab,
            dim=dim,
            norm=qwen3._qwen3_norm(dim),
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT),
            layers=blocks,
        )
    )


def build_model() -> qwen3.Qwen3Model:
    model = config().build()
    model.init_states()
    return model


def loss(output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(output, inputs)  # torchtitan's model returns the logits themselves
