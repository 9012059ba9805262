# plans/llama_custom_styles.sl — styles beyond the built-ins, declared with `use`: torch's
# PrepareModuleInputOutput (a ParallelStyle class), and a user function from examples/styles.py.
# The feed-forward block leaves w2's output partial and all-reduces it at the block's boundary.
# Model: examples/llama.py.
shardlang 1

use torch.distributed.tensor.parallel.PrepareModuleInputOutput as prepare_io
use examples.styles.rowwise_scaled as rowwise_scaled

mesh world = auto[dp=auto, tp=2]

parallelize layers.* on world.tp {
    attention.{wq,wk,wv} : colwise
    attention.wo         : rowwise_scaled(scale=0.5)
    feed_forward         : prepare_io(input_layouts=replicate, desired_input_layouts=replicate,
                                      output_layouts=partial, desired_output_layouts=replicate)
    feed_forward.{w1,w3} : colwise
    feed_forward.w2      : rowwise(output=partial)
}

fully_shard on world.dp {
    each layers.*
}

# No `init` check: rowwise_scaled rescales wo and w2 as it shards them (an init trick), so the sharded
# model deliberately does not start where the unsharded one would.
verify gradients(steps=2), placements, module_states, init_device
