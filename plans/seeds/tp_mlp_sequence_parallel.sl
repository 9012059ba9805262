# Seed: test_tp_examples.py :: test_mlp_training / test_mlp_inference (is_seq_parallel=True)
# Sequence parallelism: each TP rank holds its slice of the sequence; the norm runs on it, net1
# gathers the sequence, net2 scatters it back. (plans/mlp_tp.sl is the is_seq_parallel=False case.)
# Model: examples/seeds/seq_mlp.py.
shardlang 1

mesh world = auto[tp=auto]

parallelize on world.tp {
    norm : sequence_parallel
    net1 : colwise(input=shard(1))
    net2 : rowwise(output=shard(1))
}

verify gradients(steps=2, input=shard(1), output=shard(1)), placements, module_states, init_device, comms
