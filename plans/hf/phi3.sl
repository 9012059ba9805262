# plans/hf/phi3.sl — written by `shardlang init examples/hf_phi3.py --tp 2`, then reviewed: transformers'
# Phi3ForCausalLM, whose projections are fused. transformers' plan gathers the output of both fused
# layers and splits the input of the layers after them, so every rank computes the whole attention and
# MLP. The review keeps that for attention (qkv_proj packs q, k and v of different widths under
# grouped-query attention, 64 + 32 + 32 rows, and the model splits it by the global head counts) but
# splits the MLP for real: gate_up_proj packed_colwise (rank k holds the k-th slice of gate and of up,
# so the model's own chunk(2) pairs them) and down_proj rowwise on the local slice.
# Model: examples/hf_phi3.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/hf/phi3.sl examples/hf_phi3.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

# Tensor parallelism, from the model's own tp_plan (transformers).
parallelize on world.tp {
    model.layers.*.self_attn.qkv_proj : colwise_gather_output
    model.layers.*.self_attn.o_proj   : rowwise_split_input
    model.layers.*.mlp.gate_up_proj   : packed_colwise           # reviewed: was colwise_gather_output
    model.layers.*.mlp.down_proj      : rowwise                  # reviewed: was rowwise_split_input
    lm_head                           : colwise_gather_output
    model.embed_tokens                : rowwise(input=replicate)
}

# FSDP2: one unit per repeated block, and the root (the rest).
fully_shard on world.dp {
    each model.layers.*
    mixed_precision(param=bf16, reduce=fp32)
}

# Parameters on the meta device, each shard initialised on its own rank by the model's own
# initialisers; buffers computed at construction are kept.
init meta

# No verify statement: apply runs all six checks.
