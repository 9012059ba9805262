# plans/field/bloom.sl — transformers' BloomForCausalLM (issue 23's field bed), written by hand:
# transformers gives Bloom no tp_plan, and its attention cannot be split over heads as it stands (it views
# the fused query_key_value with its own head count and builds the ALiBi bias for all 4 heads), so the
# attention stays whole on every tp rank and only the MLP is tensor parallel. The output layer is tied to
# the embedding: no rule for either. FSDP2 over the blocks, built on the CPU.
# Model: examples/field/bloom.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/field/bloom.sl examples/field/bloom.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize transformer.h.* on world.tp {
    mlp.dense_h_to_4h : colwise
    mlp.dense_4h_to_h : rowwise
}

fully_shard on world.dp {
    each transformer.h.*
}

init cpu
verify init, init_device, placements, module_states, gradients(steps=1)
