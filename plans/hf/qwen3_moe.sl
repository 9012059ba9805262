# plans/hf/qwen3_moe.sl — written by `shardlang init examples/hf_qwen3_moe.py --tp 2`, reviewed unchanged:
# transformers' Qwen3MoeForCausalLM, a mixture of experts, tensor parallel as the model's tp_plan says.
# Attention splits by head; every expert splits by its intermediate width (`expert_tensor_parallel`,
# transformers' moe_tp_experts: each tp rank holds a slice of every expert's gate, up and down
# projections, computes every expert on every token, and the partial outputs are summed over tp); FSDP2
# shards each layer, experts included, over dp. The rules of the model's plan that shardlang has no
# style for are kept as comments saying why.
# The experts run transformers' default grouped matmul (torch._grouped_mm), which has no float64 kernel:
# the gradients check's float64 truth computes it by one float64 matmul per expert.
# Model: examples/hf_qwen3_moe.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/hf/qwen3_moe.sl examples/hf_qwen3_moe.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

# Tensor parallelism, from the model's own tp_plan (transformers).
parallelize on world.tp {
    model.layers.*.self_attn.q_proj         : colwise
    model.layers.*.self_attn.k_proj         : colwise
    model.layers.*.self_attn.v_proj         : colwise
    model.layers.*.self_attn.q_norm         : replicated_with_grad_allreduce
    model.layers.*.self_attn.k_norm         : replicated_with_grad_allreduce
    model.layers.*.self_attn.o_proj         : rowwise
    # model.layers.*.mlp.experts.gate_up_proj : packed_colwise: a parameter, not a module: its module's rule says how it is laid out
    # model.layers.*.mlp.experts.down_proj    : rowwise: a parameter, not a module: its module's rule says how it is laid out
    model.layers.*.mlp.experts              : expert_tensor_parallel
    # model.layers.*.mlp.gate_proj            : colwise: no such module in this model
    # model.layers.*.mlp.up_proj              : colwise: no such module in this model
    # model.layers.*.mlp.down_proj            : rowwise: no such module in this model
    lm_head                                 : colwise_gather_output
    model.embed_tokens                      : rowwise(input=replicate)
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
