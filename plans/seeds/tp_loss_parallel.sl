# Seed: test_tp_examples.py :: test_loss_parallel
# Cross-entropy on logits sharded over the classes, under loss_parallel(): no gather of the logits.
# Model: examples/seeds/classifier.py.
shardlang 1

mesh world = auto[tp=auto]

parallelize on world.tp {
    output : colwise(output=shard(-1), local_output=false)
}

loss_parallel
verify gradients(steps=2), comms, placements, module_states, init_device
