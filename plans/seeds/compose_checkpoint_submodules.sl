# Seed: test_compose.py :: test_checkpoint_fsdp_submodules_non_reentrant
# Each unit is an FSDP2 unit (fully_shard, where the original used the composable FSDP1 wrapper), and
# each unit's inner sequence is checkpointed (non-reentrant).
# Model: examples/seeds/composite.py.
shardlang 1

mesh world = auto[dp=auto]

checkpoint u1.seq, u2.seq

fully_shard on world.dp {
    each u1
    each u2
}

# No module_states: FSDP over the only mesh dim shards every parameter and the model has no buffers,
# so no tensor is replicated and the check would compare nothing (it would be skipped, not passed).
verify init, gradients(steps=2), placements, init_device
