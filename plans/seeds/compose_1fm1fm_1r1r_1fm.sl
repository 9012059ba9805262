# Seed: test_compose.py :: test_fully_shard_replicate_composability, config "1fm1fm,1r1r,1fm"
# Bottom: both inner sequences fully sharded; middle: both units replicated; top: the model fully
# sharded. Units are wrapped children first whatever order the blocks come in.
# Model: examples/seeds/composite_param.py.
shardlang 1

mesh world = auto[dp=auto]

fully_shard on world.dp {
    each u1.seq
    each u2.seq
}

replicate on world.dp {
    each u1
    each u2
    root = false
}

verify gradients(steps=2), placements, init_device, module_states
