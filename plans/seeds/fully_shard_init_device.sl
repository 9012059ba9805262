# Seed: test_fully_shard_init.py :: test_move_states_to_device_tensor (and ..._dtensor)
# Built on each rank's CPU, then moved by sharding: every parameter and buffer ends on the mesh device.
# Model: examples/buffers.py.
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize on world.tp {
    net1 : colwise
    net2 : rowwise
}

fully_shard on world.dp { }

init cpu
verify init_device, placements, module_states
