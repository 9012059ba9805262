# benchmarks/plans/mixtral_ep_fsdp.sl — the plan `benchmarks/ep_compare.py --fsdp` times (4 GPUs: EP 2 x
# FSDP 2): plans/hf/olmoe_ep_fsdp.sl's layout on the 1.2B Mixtral. The experts split over ep and borrow
# the data-parallel ranks (each rank trains on its own data), everything else FSDP2 over dp x ep, the
# experts over dp with their gradients divided by dp x ep (torchtitan's layout).
shardlang 1

mesh world = auto[dp=auto, ep=2]

parallelize on world.ep {
    model.layers.*.mlp.experts : expert_parallel
}

fully_shard on world[dp*ep] {
    each model.layers.*
    mixed_precision(param=bf16, reduce=fp32)
}
