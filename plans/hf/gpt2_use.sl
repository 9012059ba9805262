# plans/hf/gpt2_use.sl — plans/hf/gpt2.sl with the user's own styles instead of the built-in *_conv1d ones:
# torch's ColwiseParallel and RowwiseParallel subclassed for transformers' Conv1D (examples/styles.py),
# which stores its weight [in, out], so colwise shards the weight's dim 1 where nn.Linear's is dim 0.
# apply predicts what a `use` style places by running it on a meta copy of its module in a simulated
# world: the placements check compares against that, not against the base class's nn.Linear layout.
# Model: examples/hf_gpt2.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/hf/gpt2_use.sl examples/hf_gpt2.py --nproc 4
shardlang 1

use examples.styles.ColwiseConv1D as colwise_c1d
use examples.styles.RowwiseConv1D as rowwise_c1d

mesh world = auto[dp=auto, tp=2]

parallelize transformer.h.* on world.tp {
    attn.c_attn : colwise_c1d(output_layouts=replicate)
    attn.c_proj : rowwise_c1d(input_layouts=replicate)
    mlp.c_fc    : colwise_c1d
    mlp.c_proj  : rowwise_c1d
}

fully_shard on world.dp {
    each transformer.h.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta

verify gradients(steps=2), init, module_states, init_device, placements
