# Seed: test_compose.py :: test_fully_shard_replicate_composability, config "1fm,1r"
# Bottom level: `l1` fully sharded (m: named); next level up: the model replicated.
# Model: examples/seeds/composite.py.
shardlang 1

mesh world = auto[dp=auto]

fully_shard on world.dp {
    each l1
    root = false
}

replicate on world.dp { }

verify gradients(steps=2), placements, init_device, module_states
