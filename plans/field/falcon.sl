# plans/field/falcon.sl — transformers' FalconForCausalLM, new decoder architecture (issue 23's field
# bed), written by hand: transformers gives Falcon no tp_plan, and neither block half can be split with
# torch's styles as the model stands. Its attention reshapes q with its own head count after splitting
# the fused query_key_value, and its decoder adds the attention output *in place* into the MLP's output
# (`mlp_output += attention_output`), which a rowwise dense_4h_to_h hands over as a view of a DTensor
# (`to_local()`): autograd refuses the in-place add. So the blocks stay whole on every tp rank, the
# embedding is split over the vocabulary and the output layer over its classes; FSDP2 over the blocks
# in bf16, built on meta.
# Model: examples/field/falcon.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/field/falcon.sl examples/field/falcon.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize on world.tp {
    transformer.word_embeddings : rowwise(input=replicate)
    lm_head                     : colwise_gather_output
}

fully_shard on world.dp {
    each transformer.h.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
verify init, init_device, placements, module_states, gradients(steps=1)
