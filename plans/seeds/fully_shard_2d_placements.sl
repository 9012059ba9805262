# Seed: test_fully_shard_init.py :: test_shard_dtensor_parameters / test_2d_mlp_with_nd_mesh
# A colwise/rowwise MLP under FSDP2 on a (dp, tp) mesh: the placements torch produces, predicted.
# Model: examples/mlp.py.
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize on world.tp {
    net1 : colwise
    net2 : rowwise
}

fully_shard on world.dp { }

verify placements, gradients(steps=2), module_states, init_device
