# torchtitan's own Llama3 1B, FSDP2 over every GPU, with the units torchtitan's apply_fsdp_to_decoder
# makes for a model whose embedding and output layer share one weight (the 1B's enable_weight_tying): the
# embedding, the final norm and lm_head as one unit (the tied weight gathered once), kept gathered after the
# forward since the backward starts there; each block a unit; then the root. bf16 parameters, fp32
# gradient reduction, forward inputs not cast (torchtitan's MixedPrecisionPolicy). Built on meta,
# materialised on the GPUs and initialised as torchtitan's trainer does: init_states on the root.
# Model: benchmarks/titan_1b.py (the benchmark: benchmarks/titan_compare.py --config fsdp).
# Checked on CPU with the dry run's model (benchmarks/titan_1b_tiny.py):
#   shardlang apply benchmarks/plans/titan_1b_fsdp.sl benchmarks/titan_1b_tiny.py --nproc 2
shardlang 1

mesh world = auto[dp=auto]

fully_shard on world.dp {
    unit tok_embeddings, norm, lm_head (reshard_after_forward=false)
    each layers.*
    mixed_precision(param=bf16, reduce=fp32, cast_forward_inputs=false)
}

init meta with init_states
verify init, init_device, placements, module_states, gradients(steps=1), comms
