# plans/field/mpt.sl — transformers' MptForCausalLM (issue 23's field bed), written by hand: transformers
# gives MPT no tp_plan, and its attention reshapes q, k and v with its own head count and adds an ALiBi
# bias built for all 4 heads, so the attention stays whole on every tp rank and only the MLP is tensor
# parallel. The output layer is tied to the embedding: no rule for either. FSDP2 over the blocks, built
# on meta.
# Model: examples/field/mpt.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/field/mpt.sl examples/field/mpt.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize transformer.blocks.* on world.tp {
    ffn.up_proj   : colwise
    ffn.down_proj : rowwise
}

fully_shard on world.dp {
    each transformer.blocks.*
}

init meta
verify init, init_device, placements, module_states, gradients(steps=1)
