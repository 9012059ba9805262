# Seed: test_fully_shard_init.py :: test_hsdp_broadcast_across_replicas
# Hybrid sharding where each rank built different weights: `sync over world.replicate` makes the
# replicas agree (broadcast from the first replica), then a training step matches the reference.
# Model: examples/seeds/per_rank_mlp.py.
shardlang 1

mesh world = auto[replicate=auto, shard=2]

fully_shard on world[replicate, shard] {
    each 0
    each 2
}

sync over world.replicate
verify module_states, gradients(steps=1), placements, init_device
