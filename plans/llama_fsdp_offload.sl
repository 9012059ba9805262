# plans/llama_fsdp_offload.sl — FSDP2 with parameters, gradients and optimizer states kept on the CPU
# (`offload = cpu`): each block is a unit, the final norm and the output layer one more, then the root;
# bf16 compute with fp32 gradient reduction; built on the meta device. On GPUs the shards are initialised
# there (each its own values) and then moved to pinned CPU memory, where FSDP copies each unit in for its
# forward and backward; the optimizer steps on the CPU.
# Model: examples/llama.py. Run: shardlang apply plans/llama_fsdp_offload.sl examples/llama.py --nproc 2
shardlang 1

mesh world = auto[dp=auto]

fully_shard on world.dp {
    each layers.*
    unit norm, output                       # one unit over both, as torchtitan groups them: one all-gather
    mixed_precision(param=bf16, reduce=fp32)
    offload = cpu
}

init meta
verify init, gradients(steps=2), module_states, init_device, placements
