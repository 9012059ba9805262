# Seed: test_fully_shard_init.py :: test_meta_device_2d_init
# As fully_shard_meta_init_1d on a (dp, tp) mesh with TP first.
# Model: examples/seeds/uneven.py.
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize on world.tp {
    even : colwise
    odd  : rowwise
}

fully_shard on world.dp {
    each even
    each odd
}

init meta
verify init_device, placements, gradients(steps=2, optimizer=adam), module_states
