# The ~1B Llama (benchmarks/llama_1b.py's sizes) under context parallelism over every GPU: each sequence
# split head-tail over cp, every block's attention over the whole sequence's keys and values, FSDP2 over
# the same ranks (dp is 1 on 2 GPUs), bf16 compute with fp32 reduction. The benchmark:
# benchmarks/cp_compare.py (against torch's context_parallel written by hand). Checked on CPU with the
# small model: shardlang apply benchmarks/plans/llama_1b_cp.sl examples/llama.py --nproc 2
shardlang 1

param cp = 2

mesh world = auto[dp=auto, cp=$cp]

context_parallel on world.cp {
    each layers.*.attention
    output = local          # the loss on each rank's shard of the logits (labels: plan.context_shard)
}

fully_shard on world[dp*cp] {
    each layers.*
    mixed_precision(param=bf16, reduce=fp32)
}
