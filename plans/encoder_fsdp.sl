# plans/encoder_fsdp.sl — torch's own nn.TransformerEncoder, FSDP2 over its layers, built on the meta
# device: each nn.MultiheadAttention initialises in _reset_parameters, each Linear and LayerNorm in
# reset_parameters, children before parents as their constructors do.
# Model: examples/encoder.py. Run: shardlang apply plans/encoder_fsdp.sl examples/encoder.py --nproc 2
shardlang 1

mesh world = auto[dp=auto]

fully_shard on world.dp {
    each layers.*
}

init meta
verify init, gradients(steps=2), init_device, placements
