# plans/field/exaone4.sl — written by `shardlang init examples/field/exaone4.py --tp 2`, reviewed
# unchanged: transformers' Exaone4ForCausalLM (issue 23's field bed), tensor parallel as its tp_plan
# says. q_norm and k_norm apply one [16] weight to every head, each tp rank to its own heads, so their
# gradients are summed over tp (replicated_with_grad_allreduce). FSDP2 over the layers, built on meta.
# Model: examples/field/exaone4.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/field/exaone4.sl examples/field/exaone4.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

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

fully_shard on world.dp {
    each model.layers.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
verify init, init_device, placements, module_states, gradients(steps=1)
