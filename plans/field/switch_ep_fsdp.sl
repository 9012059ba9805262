# plans/field/switch_ep_fsdp.sl — transformers' SwitchTransformersEncoderModel, whose experts are an
# nn.ModuleDict of whole MLPs (experts.expert_0 ... expert_3), split by member over ep: each ep rank keeps
# 4 / ep of them under their own names and drops the rest; every token goes to the rank holding its
# expert and comes back weighted (two all-to-alls a layer). The experts borrow the data-parallel ranks,
# as in plans/hf/olmoe_ep_fsdp.sl: FSDP shards everything else over dp*ep, the experts over dp.
# Model: examples/field/switch.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/field/switch_ep_fsdp.sl examples/field/switch.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, ep=2]

parallelize on world.ep {
    encoder.block.*.layer.1.mlp.experts : expert_parallel
}

fully_shard on world[dp*ep] {
    each encoder.block.*
}

verify init, init_device, placements, gradients(steps=1)
