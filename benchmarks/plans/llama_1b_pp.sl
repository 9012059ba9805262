# The 1B benchmark model in two pipeline stages, FSDP2 over the rest in each stage; bf16 compute with fp32
# reduction; built on meta and materialised on the GPUs. Model: benchmarks/llama_1b.py.
shardlang 1
param schedule = 1f1b
param per_rank = 1
param microbatches = 8

mesh world = auto[pp=2, dp=auto]

pipeline on world.pp {
    split layers.* into auto
    schedule = $schedule
    microbatches = $microbatches
    stages_per_rank = $per_rank
}

fully_shard on world.dp {
    each layers.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
verify gradients(steps=2, batch=8), module_states, init_device, placements, comms
