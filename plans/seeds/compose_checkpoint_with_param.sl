# Seed: test_compose.py :: test_checkpoint_fsdp_submodules_with_param
# Checkpointed inner sequences, one FSDP2 unit at the root (which also holds a parameter of its own).
# Model: examples/seeds/composite_param.py.
shardlang 1

mesh world = auto[dp=auto]

checkpoint u1.seq, u2.seq
fully_shard on world.dp { }

verify gradients(steps=2), placements, init_device, module_states
