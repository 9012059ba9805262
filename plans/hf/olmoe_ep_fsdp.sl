# plans/hf/olmoe_ep_fsdp.sl — transformers' OlmoeForCausalLM laid out as torchtitan lays out MoE models:
# expert parallelism borrows the data-parallel ranks. Every rank trains on its own batch; each layer's
# 4 experts are 2 a rank on the ep dim, and each rank sends its tokens to the ranks holding their chosen
# experts and back (two all-to-alls a layer). FSDP2 shards everything else over dp*ep, all the ranks
# (`world[dp*ep]`: the two dims flattened into one); the experts, already split over ep, get their own
# unit over dp, with their gradients divided by dp*ep, as torchtitan's `efsdp` mesh does. Attention stays
# whole (OLMoE normalises q and k over every head at once).
# Model: examples/field/olmoe.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/hf/olmoe_ep_fsdp.sl examples/field/olmoe.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, ep=2]

parallelize on world.ep {
    model.layers.*.mlp.experts : expert_parallel
}

fully_shard on world[dp*ep] {
    each model.layers.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
