# plans/field/falcon.sl — transformers' FalconForCausalLM, new decoder architecture (issue 23's field
# bed), written by hand: transformers gives Falcon no tp_plan, and its attention reshapes q with its own
# head count after splitting the fused query_key_value, so the attention stays whole on every tp rank;
# the MLP (FalconLinear, an nn.Linear) is tensor parallel. FSDP2 over the blocks in bf16, built on meta.
# Model: examples/field/falcon.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/field/falcon.sl examples/field/falcon.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize transformer.h.* on world.tp {
    mlp.dense_h_to_4h : colwise
    mlp.dense_4h_to_h : rowwise
}

fully_shard on world.dp {
    each transformer.h.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
verify init, init_device, placements, module_states, gradients(steps=1)
