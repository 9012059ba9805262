# plans/llama_loss_parallel.sl — tensor parallelism with the loss computed on vocabulary-sharded
# logits: the output layer keeps its logits as a DTensor sharded on the last dim, and cross-entropy
# runs under loss_parallel() without gathering them (PyTorch's test_loss_parallel).
# Model: examples/llama.py (its loss is next-token cross-entropy).
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize on world.tp {
    tok_embeddings : rowwise(input=replicate, output=shard(1))
    norm           : sequence_parallel
    output         : colwise(input=shard(1), output=shard(-1), local_output=false)
}

parallelize layers.* on world.tp {
    attention_norm         : sequence_parallel
    attention              : prepare_input(input=(shard(1), _), desired=(replicate, _))
    attention.{wq,wk,wv}   : colwise
    attention.wo           : rowwise(output=shard(1))
    ffn_norm               : sequence_parallel
    feed_forward           : prepare_input(input=shard(1), desired=replicate)
    feed_forward.{w1,w3}   : colwise
    feed_forward.w2        : rowwise(output=shard(1))
}

fully_shard on world.dp {
    each layers.*
}

loss_parallel
verify init, gradients(steps=2, optimizer=adamw), placements, module_states, init_device, comms
