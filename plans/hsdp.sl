# plans/hsdp.sl — hybrid sharding (HSDP): parameters sharded within each group of `shard` ranks and
# replicated across groups; gradients reduce-scattered inside a group and all-reduced across groups.
# Model: examples/llama.py.
shardlang 1
param shard = 2

mesh world = auto[replicate=auto, shard=$shard]

fully_shard on world[replicate, shard] {
    each layers.*
    mixed_precision(param=fp32, reduce=fp32)
}

init rank0                                  # build once on rank 0, scatter the shards
verify init, gradients(steps=2, optimizer=adamw), module_states, placements, init_device
