# plans/field/mixtral.sl — written by `shardlang init examples/field/mixtral.py --tp 2`, reviewed
# unchanged: transformers' MixtralForCausalLM, a mixture of experts (issue 23's field bed). Attention,
# the embedding and the output layer are tensor parallel as the model's tp_plan says; the experts (two
# 3-D tensors per layer, transformers' default grouped matmul) stay whole on every tp rank and FSDP2
# shards them over dp with the rest of each layer. The rules shardlang has no style for stay comments.
# Model: examples/field/mixtral.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/field/mixtral.sl examples/field/mixtral.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize on world.tp {
    model.layers.*.self_attn.q_proj         : colwise
    model.layers.*.self_attn.k_proj         : colwise
    model.layers.*.self_attn.v_proj         : colwise
    model.layers.*.self_attn.o_proj         : rowwise
    # model.layers.*.mlp.experts.gate_up_proj : packed_colwise: a parameter, not a module: its module's rule says how it is laid out
    # model.layers.*.mlp.experts.down_proj    : rowwise: a parameter, not a module: its module's rule says how it is laid out
    # model.layers.*.mlp.experts              : moe_tp_experts: no built-in style: the experts stay whole on each tp rank; fully_shard shards them over dp
    lm_head                                 : colwise_gather_output
    model.embed_tokens                      : rowwise(input=replicate)
}

fully_shard on world.dp {
    each model.layers.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
verify init, init_device, placements, module_states, gradients(steps=1)
