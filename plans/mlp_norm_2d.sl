# plans/mlp_norm_2d.sl — 2-D TP + FSDP2 over a sequence-parallel MLP with a distributed RMSNorm
# (PyTorch's test_fsdp_tp_integration). The norm runs on each rank's shard of the batch: its input is
# wrapped as a DTensor sharded on dim 0 and its output handed back as a local tensor.
# Model: examples/mlp_norm.py.
shardlang 1
param tp = 2

mesh world = auto[dp=auto, tp=$tp]

parallelize on world.tp {
    mlp_norm : distribute(input=shard(0), output=local)
    mlp.net1 : colwise(input=shard(0))
    mlp.net2 : rowwise(output=shard(0))
}

fully_shard on world.dp {
    each mlp
}

verify gradients(steps=2, input=shard(0), output=shard(0)), module_states, placements, init_device
