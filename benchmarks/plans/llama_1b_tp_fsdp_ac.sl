# The 1B benchmark model, TP 2 (sequence parallel, torchtitan-style) x FSDP2 over the rest, every block checkpointed; bf16
# compute with fp32 reduction; built on meta and materialised on the GPUs.
# Model: benchmarks/llama_1b.py.
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize on world.tp {
    tok_embeddings : rowwise(input=replicate, output=shard(1))
    norm           : sequence_parallel
    output         : colwise(input=shard(1), output=replicate)
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

checkpoint layers.*

fully_shard on world.dp {
    each layers.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
verify gradients(steps=2, batch=1), module_states, init_device, placements, comms
