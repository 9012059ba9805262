# Seed: test_fully_shard_init.py :: test_meta_device_1d_init
# Built on meta, sharded, then materialised on the mesh device with reset_parameters; every shard has
# its own values (on a CPU mesh too) and an optimizer step works.
# Model: examples/seeds/uneven.py.
shardlang 1

mesh world = auto[dp=auto]

fully_shard on world.dp {
    each even
    each odd
}

init meta
# No module_states: FSDP over the only mesh dim shards every parameter and the model has no buffers,
# so no tensor is replicated and the check would compare nothing (it would be skipped, not passed).
verify init, init_device, placements, gradients(steps=2, optimizer=adam)
