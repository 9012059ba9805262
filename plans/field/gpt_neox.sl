# plans/field/gpt_neox.sl — transformers' GPTNeoXForCausalLM (issue 23's field bed), tensor parallel as
# its tp_plan says. Its fused query_key_value is laid out head by head ([q_0; k_0; v_0; q_1; ...]) and
# the model views it with -1 heads, so a plain colwise split hands each rank whole heads; dense and the
# MLP's second layer are rowwise, the embedding rowwise over the vocabulary. FSDP2 over the layers,
# built on the mesh device (init auto).
# Model: examples/field/gpt_neox.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/field/gpt_neox.sl examples/field/gpt_neox.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize on world.tp {
    gpt_neox.embed_in : rowwise(input=replicate)
    lm_head           : colwise_gather_output
}
parallelize gpt_neox.layers.* on world.tp {
    attention.query_key_value : colwise
    attention.dense           : rowwise
    mlp.dense_h_to_4h         : colwise
    mlp.dense_4h_to_h         : rowwise
}

fully_shard on world.dp {
    each gpt_neox.layers.*
}

init auto
verify init, init_device, placements, module_states, gradients(steps=1)
