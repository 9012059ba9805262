# plans/hf/qwen3_moe_ep.sl — transformers' Qwen3MoeForCausalLM with its experts split by expert over the
# tensor-parallel ranks: each of the 2 tp ranks keeps 2 of a layer's 4 experts, routes its half of the
# batch's tokens to the rank holding their chosen experts and gathers the results back (two all-to-alls
# a layer). Attention is tensor parallel as the model's tp_plan says; the router stays whole. FSDP2
# shards everything, the experts' halves included, over dp.
# The tp ranks share their batch, so no token is computed twice; ranks of an ep dim that train on
# different data (world[dp*ep]) come next.
# Model: examples/hf_qwen3_moe.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/hf/qwen3_moe_ep.sl examples/hf_qwen3_moe.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize on world.tp {
    model.layers.*.self_attn.{q_proj,k_proj,v_proj} : colwise
    model.layers.*.self_attn.{q_norm,k_norm}        : replicated_with_grad_allreduce
    model.layers.*.self_attn.o_proj                 : rowwise
    model.layers.*.mlp.experts                      : expert_parallel
    lm_head                                         : colwise_gather_output
    model.embed_tokens                              : rowwise(input=replicate)
}

fully_shard on world.dp {
    each model.layers.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
