# Seed: test_compose.py :: test_checkpoint_fully_shard_cast_forward_inputs
# `c2` computes in fp16 and casts its inputs to fp16; the root computes in fp32 and casts to fp32.
# With `c2` checkpointed, its recomputed forward must still see fp16 inputs (FSDP2's
# MixedPrecisionPolicy where the original used FSDP1's MixedPrecision).
# Model: examples/seeds/forward_inputs.py.
shardlang 1

mesh world = auto[dp=auto]

checkpoint c2

fully_shard on world.dp {
    each c2 (mixed_precision(param=fp16, cast_forward_inputs=true))
    mixed_precision(param=fp32, cast_forward_inputs=true)
}

verify init_device, placements
