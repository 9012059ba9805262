# plans/field/titan_qwen3_moe_ep_fsdp.sl — torchtitan 0.3.0's own Qwen3-MoE laid out as torchtitan's
# parallelize_qwen3 lays it out with expert parallelism: the experts borrow the data-parallel ranks.
# Each rank trains on its own batch; torchtitan's dispatcher sorts each layer's (token, choice) pairs by
# expert on the rank, and the grouped experts (`inner_experts`, 8 a layer, 8 / ep a rank) receive them
# grouped by expert with each expert's count: expert_parallel sends each rank the rows of its experts
# and brings the results back (an all-to-all of the counts, two of the rows a layer); the dispatcher then
# weights them and sums them into their tokens on the rank they came from, as without EP. FSDP2 units
# as torchtitan makes them, over dp*ep (every rank): the embedding, each block, and the final norm with
# the output layer as one unit; the experts, already split over ep, get their own unit over dp.
# Parameters on the meta device, initialised as torchtitan's trainer does, by init_states on the root.
# Model: examples/field/titan_qwen3_moe.py (needs pip install -e '.[titan]').
# Run: shardlang apply plans/field/titan_qwen3_moe_ep_fsdp.sl examples/field/titan_qwen3_moe.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, ep=2]

parallelize on world.ep {
    layers.*.moe.routed_experts.inner_experts : expert_parallel
}

fully_shard on world[dp*ep] {
    each tok_embeddings
    each layers.*
    unit norm, lm_head (reshard_after_forward=false)
    mixed_precision(param=bf16, reduce=fp32)
}

init meta with init_states
verify init, init_device, placements, module_states, gradients(steps=1)
