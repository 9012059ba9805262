# plans/mlp_tp.sl — the two-layer MLP of PyTorch's TP examples: net1 column-wise, net2 row-wise,
# so the only collective in the forward pass is net2's all-reduce.
# Model: examples/mlp.py.
shardlang 1

mesh world = auto[tp=auto]

parallelize on world.tp {
    net1 : colwise
    net2 : rowwise
}

verify gradients(steps=3, optimizer=sgd), placements, init_device, module_states,
       comms(all_reduce=1)                  # net2 sums its partial outputs; the input needs no gradient
