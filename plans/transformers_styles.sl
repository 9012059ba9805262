# plans/transformers_styles.sl — the built-in styles for layouts transformers' models bring, each on
# the layer it is for: a packed [gate; up] projection with a bias (each rank holds the k-th slice of
# both parts), a per-head norm whose replicated weight sums its gradient over tp, transformers' Conv1D
# layout (weight [in, out]) and a colwise layer whose output is gathered for the next to split again.
# TP over tp, FSDP2 over dp, built on meta.
# Model: examples/fused.py
# Run: shardlang apply plans/transformers_styles.sl examples/fused.py --nproc 4
shardlang 1
param tp = 2

mesh world = auto[dp=auto, tp=$tp]

parallelize on world.tp {
    mlp.gate_up    : packed_colwise(parts=2)
    mlp.down       : rowwise
    attn.qk        : colwise
    attn.head_norm : replicated_with_grad_allreduce
    attn.out       : rowwise
    ffn.fc         : colwise_conv1d
    ffn.proj       : rowwise_conv1d
    head.gather    : colwise_gather_output
    head.split     : rowwise_split_input
}

fully_shard on world.dp {
    each {mlp, attn, ffn}
}

init meta
