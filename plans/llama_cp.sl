# plans/llama_cp.sl — context parallelism: each sequence split over the cp ranks, head-tail balanced
# (rank r holds chunks r and 2cp-1-r of 2cp, as many early tokens as late ones under the causal mask);
# every block's attention computes its shard's queries against the whole sequence's keys and values,
# gathered over cp. The model takes `position_ids`, so each shard's rotary angles are its own. The cp
# ranks are data-parallel for the gradients: FSDP2 shards and reduces over dp*cp, all the ranks.
# Model: examples/llama.py. Run: shardlang apply plans/llama_cp.sl examples/llama.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, cp=2]

context_parallel on world.cp {
    each layers.*.attention
    load_balance = headtail
}

fully_shard on world[dp*cp] {
    each layers.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
