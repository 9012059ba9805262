# plans/hf/mistral.sl — written by `shardlang init examples/hf_mistral.py --tp 2`, reviewed unchanged:
# transformers' MistralForCausalLM with its own tp_plan translated rule by rule (attention and MLP
# colwise/rowwise, the output layer gathering its logits, the embedding split over the vocabulary),
# FSDP2 over the decoder layers, bf16 compute, built on meta.
# Model: examples/hf_mistral.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/hf/mistral.sl examples/hf_mistral.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

# Tensor parallelism, from the model's own tp_plan (transformers).
parallelize on world.tp {
    model.layers.*.self_attn.q_proj : colwise
    model.layers.*.self_attn.k_proj : colwise
    model.layers.*.self_attn.v_proj : colwise
    model.layers.*.self_attn.o_proj : rowwise
    model.layers.*.mlp.gate_proj    : colwise
    model.layers.*.mlp.up_proj      : colwise
    model.layers.*.mlp.down_proj    : rowwise
    lm_head                         : colwise_gather_output
    model.embed_tokens              : rowwise(input=replicate)
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
