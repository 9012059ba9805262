# Seed: test_compose.py :: test_fully_shard_replicate_correct_replicate_params (the wrapping part)
# Every nn.Linear an FSDP2 unit of its own, chosen by class; the rest replicated by the root unit.
# Model: examples/seeds/composite_param.py.
shardlang 1

mesh world = auto[dp=auto]

fully_shard on world.dp {
    each class Linear
    root = false
}

replicate on world.dp { }

verify gradients(steps=2), placements, init_device, module_states
