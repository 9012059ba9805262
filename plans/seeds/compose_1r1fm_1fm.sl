# Seed: test_compose.py :: test_fully_shard_replicate_composability, config "1r1fm,1fm"
# Bottom level: `u1` replicated and `u2` fully sharded; next level up: the model fully sharded.
# Model: examples/seeds/composite_param.py.
shardlang 1

mesh world = auto[dp=auto]

replicate on world.dp {
    each u1
    root = false
}

fully_shard on world.dp {
    each u2
}

verify gradients(steps=2), placements, init_device, module_states
