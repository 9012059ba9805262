# plans/field/olmoe.sl — written by `shardlang init examples/field/olmoe.py --tp 2`, reviewed unchanged:
# transformers' OlmoeForCausalLM, a mixture of experts (issue 23's field bed). Its q and k norms span
# every head at once, so the model's tp_plan gathers q, k and v on every rank (colwise_gather_output)
# and splits o_proj's input locally (rowwise_split_input); the experts stay whole on each tp rank
# (transformers' default grouped matmul) and FSDP2 shards them over dp. Built on the CPU, then sharded.
# Model: examples/field/olmoe.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/field/olmoe.sl examples/field/olmoe.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize on world.tp {
    model.layers.*.self_attn.q_proj         : colwise_gather_output
    model.layers.*.self_attn.k_proj         : colwise_gather_output
    model.layers.*.self_attn.v_proj         : colwise_gather_output
    model.layers.*.self_attn.o_proj         : rowwise_split_input
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

init cpu
verify init, init_device, placements, module_states, gradients(steps=1)
