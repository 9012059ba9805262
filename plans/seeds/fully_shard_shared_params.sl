# Seed: test_fully_shard_init.py :: test_managed_states_shared_params_and_buffers,
#       test_managed_modules_duplicate
# Parameters and buffers shared between blocks, and a block used twice: each is managed once.
# Model: examples/seeds/shared.py.
shardlang 1

mesh world = auto[dp=auto]

fully_shard on world.dp {
    each twice
}

verify gradients(steps=2), placements, init_device, module_states
