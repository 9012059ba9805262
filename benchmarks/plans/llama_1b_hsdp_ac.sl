# The 1B benchmark model, HSDP: parameters sharded within each pair of GPUs and replicated across pairs, every block checkpointed; each
# block a unit, then the root; bf16 compute with fp32 reduction; built on meta and materialised on the GPUs.
# Model: benchmarks/llama_1b.py.
shardlang 1

mesh world = auto[replicate=auto, shard=2]

checkpoint layers.*

fully_shard on world[replicate, shard] {
    each layers.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
verify gradients(steps=2, batch=1), module_states, init_device, placements, comms
