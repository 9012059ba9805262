# The 1B benchmark model, FSDP2 over every GPU with parameters, gradients and optimizer states offloaded to the CPU: each block a unit, then the root; bf16 compute with
# fp32 reduction; built on meta and materialised on the GPUs.
# Model: benchmarks/llama_1b.py.
shardlang 1

mesh world = auto[dp=auto]

fully_shard on world.dp {
    each layers.*
    mixed_precision(param=bf16, reduce=fp32)
    offload = cpu
}

init meta
verify gradients(steps=2, batch=1), module_states, init_device, placements, comms
