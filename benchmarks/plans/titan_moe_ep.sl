# torchtitan's own Qwen3-MoE (1.2B, 8 experts a layer), laid out as torchtitan's parallelize_qwen3 lays it
# out with expert_parallel_degree = 2: the experts borrow the data-parallel ranks (every rank its own
# batch). Each layer's grouped experts split over ep, their rows sent to the rank holding their expert
# and back; FSDP2 over dp*ep (every GPU) with torchtitan's units: the embedding, each block, and the
# final norm with the output layer, kept gathered after the forward; the experts, already split over ep,
# their own unit over dp (on 2 GPUs, dp 1). bf16 parameters, fp32 gradient reduction, forward inputs not
# cast (torchtitan's MixedPrecisionPolicy). Built on meta, initialised as torchtitan's trainer does.
# Model: benchmarks/titan_moe.py (the benchmark: benchmarks/titan_compare.py --config ep).
# Checked on CPU with the dry run's model (benchmarks/titan_moe_tiny.py):
#   shardlang apply benchmarks/plans/titan_moe_ep.sl benchmarks/titan_moe_tiny.py --nproc 2
shardlang 1
param ep = 2  # titan_compare.py --ep 4 or 8 (8 GPUs: EP 4 x FSDP 2, EP 8)

mesh world = auto[dp=auto, ep=$ep]

parallelize on world.ep {
    layers.*.moe.routed_experts.inner_experts : expert_parallel
}

fully_shard on world[dp*ep] {
    each tok_embeddings
    each layers.*
    unit norm, lm_head (reshard_after_forward=false)
    mixed_precision(param=bf16, reduce=fp32, cast_forward_inputs=false)
}

init meta with init_states
verify init, init_device, placements, module_states, gradients(steps=1), comms
