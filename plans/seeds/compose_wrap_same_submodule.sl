# Seed: test_compose.py :: test_wrap_same_submodule
# The same submodule checkpointed and fully sharded, with its Linear layer a unit of its own (the
# original's ModuleWrapPolicy({nn.Linear}) on `seq`). Unlike the original, the root is a unit too,
# so that the data-parallel replicas train on different inputs and still agree.
# Model: examples/seeds/unit.py.
shardlang 1

mesh world = auto[dp=auto]

checkpoint seq

fully_shard on world.dp {
    each seq
    each seq.1
}

# No module_states: FSDP over the only mesh dim shards every parameter and the model has no buffers,
# so no tensor is replicated and the check would compare nothing (it would be skipped, not passed).
verify init, gradients(steps=2), placements, init_device
