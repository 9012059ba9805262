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

verify gradients(steps=2), placements, init_device, module_states
