# plans/field/titan_llama3.sl — torchtitan 0.3.0's own Llama3 (issue 23's field bed), laid out as
# torchtitan's parallelize does it with sequence parallelism on: the embedding hands out activations
# sharded on the sequence, every norm runs on its shard, attention and the feed-forward gather it back,
# their fused/first projections are colwise (wqkv holds whole key/value groups per rank), their last ones
# reduce-scatter to the sequence shard again, and the output layer gathers the logits. FSDP2 units as torchtitan
# makes them: the embedding, each block, and the final norm with the output layer as one unit.
# torchtitan's Embedding cannot take torch's RowwiseParallel (its forward calls to_local() itself and
# needs a tp_group torchtitan's own parallelize sets), so the embedding stays whole on every tp rank and
# only its output is split on the sequence. Parameters on the meta device, initialised as torchtitan's
# trainer does, by init_states on the root, which initialises the whole tree.
# Model: examples/field/titan_llama3.py (needs pip install -e '.[titan]').
# Run: shardlang apply plans/field/titan_llama3.sl examples/field/titan_llama3.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize on world.tp {
    tok_embeddings : prepare_output(output=replicate, desired=shard(1))
    norm           : sequence_parallel
    lm_head        : colwise(input=shard(1), output=replicate)
}

parallelize layers.* on world.tp {
    attention_norm         : sequence_parallel
    attention              : prepare_input(input=(shard(1), _, _), desired=(replicate, _, _))
    attention.qkv_linear.wqkv : colwise
    attention.wo           : rowwise(output=shard(1))
    ffn_norm               : sequence_parallel
    feed_forward           : prepare_input(input=shard(1), desired=replicate)
    feed_forward.{w1,w3}   : colwise
    feed_forward.w2        : rowwise(output=shard(1))
}

fully_shard on world.dp {                   # torchtitan's units: the embedding, each block, and the
    each tok_embeddings                     # final norm with the output layer as one unit, which
    each layers.*                           # stays gathered after the forward (the backward starts there)
    unit norm, lm_head (reshard_after_forward=false)
    mixed_precision(param=bf16, reduce=fp32)
}

init meta with init_states
verify init, init_device, placements, module_states, gradients(steps=1)
