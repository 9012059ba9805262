# plans/llama_cp_tp.sl — context parallelism beside tensor parallelism: each sequence split over cp
# (head-tail), each block's heads and feed-forward split over tp. Inside an attention module the
# projections are TP's (each tp rank holds its own heads), and SDPA runs on those heads over the whole
# sequence's keys and values, gathered over cp. FSDP2 shards and reduces over dp*cp (each cp rank
# computes the gradients of its own tokens, which the reduction sums); the tp ranks hold different shards.
# Model: examples/llama.py. Run: shardlang apply plans/llama_cp_tp.sl examples/llama.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, cp=2, tp=2]

parallelize layers.* on world.tp {
    attention.{wq,wk,wv}   : colwise
    attention.wo           : rowwise
    feed_forward.{w1,w3}   : colwise
    feed_forward.w2        : rowwise
}

context_parallel on world.cp {
    each layers.*.attention
}

fully_shard on world[dp*cp] {
    each layers.*
    mixed_precision(param=bf16, reduce=fp32)
}
