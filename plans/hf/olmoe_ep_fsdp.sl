# plans/hf/olmoe_ep_fsdp.sl — transformers' OlmoeForCausalLM with its experts split over ep and
# everything sharded by FSDP2 over dp: each layer's 4 experts are 2 a rank on the ep dim (then halved
# again by FSDP over dp); attention stays whole (OLMoE normalises q and k over every head at once). The
# ep ranks of a replica share its batch: each routes its slice of the tokens to their experts' ranks and
# gathers the results back (two all-to-alls a layer).
# Model: examples/field/olmoe.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/hf/olmoe_ep_fsdp.sl examples/field/olmoe.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, ep=2]

parallelize on world.ep {
    model.layers.*.mlp.experts : expert_parallel
}

fully_shard on world.dp {
    each model.layers.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
