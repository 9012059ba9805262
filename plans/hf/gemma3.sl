# plans/hf/gemma3.sl — written by `shardlang init examples/hf_gemma3.py --tp 2`, reviewed unchanged:
# transformers' Gemma3ForCausalLM (text) with its own tp_plan translated rule by rule. Its per-head q/k
# norms run on each rank's own heads with replicated weights whose gradients are summed over tp
# (replicated_with_grad_allreduce). The output layer shares its weight with the embedding; both split
# it over the vocabulary (Shard(0)), so the tie holds.
# Model: examples/hf_gemma3.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/hf/gemma3.sl examples/hf_gemma3.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

# Tensor parallelism, from the model's own tp_plan (transformers).
parallelize on world.tp {
    model.layers.*.self_attn.q_proj : colwise
    model.layers.*.self_attn.k_proj : colwise
    model.layers.*.self_attn.v_proj : colwise
    model.layers.*.self_attn.q_norm : replicated_with_grad_allreduce
    model.layers.*.self_attn.k_norm : replicated_with_grad_allreduce
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
