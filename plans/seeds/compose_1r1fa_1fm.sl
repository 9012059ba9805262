# Seed: test_compose.py :: test_fully_shard_replicate_composability, config "1r1fa,1fm"
# `u1` replicated; `u2` fully sharded by class (the original auto-wrapped Units under `u2`, which is
# itself one); then the model fully sharded.
# Model: examples/seeds/composite_param.py.
shardlang 1

mesh world = auto[dp=auto]

replicate on world.dp {
    each u1
    root = false
}

fully_shard on world.dp {
    each class Unit
}

verify gradients(steps=2), placements, init_device, module_states
