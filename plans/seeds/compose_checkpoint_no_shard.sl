# Seed: test_compose.py :: test_checkpoint_fsdp_submodules_with_param_no_shard
# As compose_checkpoint_with_param, with FSDP1's NO_SHARD strategy: plain data parallelism
# (lowered to composable replicate).
# Model: examples/seeds/composite_param.py.
shardlang 1

mesh world = auto[dp=auto]

checkpoint u1.seq, u2.seq
fully_shard on world.dp { strategy = no_shard }

verify gradients(steps=2), placements, init_device, module_states
