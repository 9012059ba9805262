# plans/llama_2d.sl — Llama-style transformer: TP over tp, FSDP2 over dp (docs/language.md §2).
# Model: examples/llama.py. Run: shardlang apply plans/llama_2d.sl examples/llama.py --nproc 4
shardlang 1
param tp = 2

mesh world = auto[dp=auto, tp=$tp]          # device: cuda | cpu | auto (cuda if available)

parallelize on world.tp {
    tok_embeddings : rowwise(input=replicate, output=shard(1))
    norm           : sequence_parallel
    output         : colwise(input=shard(1), output=replicate)
}

parallelize layers.* on world.tp {          # patterns below are relative to each layers.<i>
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
    each output (reshard_after_forward=false)
    mixed_precision(param=bf16, reduce=fp32)
    reshard_after_forward = true
}

init meta
verify init, gradients(steps=3), module_states, init_device, placements
