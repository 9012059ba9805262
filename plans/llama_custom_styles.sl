# plans/llama_custom_styles.sl — styles beyond the built-ins, declared with `use`:
# torch's PrepareModuleInputOutput, and a user function from examples/styles.py that gives the
# attention output projection a row-wise layout and a scaled init.
# Model: examples/llama.py.
shardlang 1

use torch.distributed.tensor.parallel.PrepareModuleInputOutput as prepare_io
use examples.styles.rowwise_scaled as rowwise_scaled

mesh world = auto[dp=auto, tp=2]

parallelize layers.* on world.tp {
    attention            : prepare_io(input_layouts=(replicate, _), desired_input_layouts=(replicate, _),
                                      output_layouts=partial, desired_output_layouts=replicate)
    attention.{wq,wk,wv} : colwise
    attention.wo         : rowwise_scaled(scale=0.5)
    feed_forward.{w1,w3} : colwise
    feed_forward.w2      : rowwise
}

fully_shard on world.dp {
    each layers.*
}

verify gradients(steps=2), placements, module_states, init_device
