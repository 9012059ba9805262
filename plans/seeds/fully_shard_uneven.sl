# Seed: test_fully_shard_init.py :: test_shard_tensor_parameters (uneven dim 0)
# A dim of 3 split over 2 or 4 ranks: FSDP's local chunks are torch.chunk's (2 + 1; 1 + 1 + 1 + 0).
# Model: examples/seeds/uneven.py.
shardlang 1

mesh world = auto[dp=auto]

fully_shard on world.dp {
    each odd
}

# No module_states: FSDP over the only mesh dim shards every parameter and the model has no buffers,
# so no tensor is replicated and the check would compare nothing (it would be skipped, not passed).
verify init, gradients(steps=2), placements, init_device
