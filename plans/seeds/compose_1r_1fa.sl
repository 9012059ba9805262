# Seed: test_compose.py :: test_fully_shard_replicate_composability, config "1r,1fa"
# `u1` replicated; the model fully sharded with every Unit a unit by class (a: auto wrap). The class
# target leaves out `u1`, which a replicate block names explicitly, as FSDP's auto-wrap policy did.
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
