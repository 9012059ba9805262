# Seed: test_tp_examples.py :: test_weight_tying
# An embedding and the output layer share one weight: embedding column-wise and output row-wise shard
# it alike (Shard(1)), so it stays one parameter, and its gradient is the sum of both uses.
# Model: examples/tied.py.
shardlang 1

mesh world = auto[tp=auto]

parallelize on world.tp {
    embedding : colwise
    fc        : rowwise
}

verify gradients(steps=2), placements, module_states, init_device
