# plans/field/titan_llama3.sl — torchtitan 0.3.0's own Llama3 (issue 23's field bed), laid out as
# torchtitan's parallelize does it with sequence parallelism on: the embedding hands out activations
# sharded on the sequence, every norm runs on its shard, attention and the feed-forward gather it back,
# their fused/first projections are colwise (wqkv holds whole key/value groups per rank), their last ones
# reduce-scatter to the sequence shard again, and the output layer gathers the logits. FSDP2 per block.
# Built on the CPU (build_model runs torchtitan's own init_states) and then sharded: torchtitan's trainer
# builds on meta and runs init_states on the shards, but on a CPU mesh DTensor's random ops draw the same
# numbers on every rank (torch warns), which the init check rightly reports as identical shards.
# Model: examples/field/titan_llama3.py (needs pip install -e '.[titan]').
# Run: shardlang apply plans/field/titan_llama3.sl examples/field/titan_llama3.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize on world.tp {
    tok_embeddings : rowwise(input=replicate, output=shard(1))
    norm           : sequence_parallel
    lm_head        : colwise(input=shard(1), output=replicate)
}

parallelize layers.* on world.tp {
    attention_norm         : sequence_parallel
    attention              : prepare_input(input=(shard(1), _), desired=(replicate, _))
    attention.qkv_linear.wqkv : colwise
    attention.wo           : rowwise(output=shard(1))
    ffn_norm               : sequence_parallel
    feed_forward           : prepare_input(input=shard(1), desired=replicate)
    feed_forward.{w1,w3}   : colwise
    feed_forward.w2        : rowwise(output=shard(1))
}

fully_shard on world.dp {
    each layers.*
    mixed_precision(param=bf16, reduce=fp32)
}

init cpu
verify init, init_device, placements, module_states, gradients(steps=1)
