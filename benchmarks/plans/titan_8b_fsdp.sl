# torchtitan's own Llama3 8B (benchmarks/titan_8b.py: untied embedding and output), FSDP2 over every GPU.
# FSDP2 with torchtitan's units for an untied model (apply_fsdp_to_decoder's other branch): the embedding
# alone, resharded after the forward; the final norm and lm_head as one unit kept gathered after it;
# each block; the root. bf16 compute, fp32 reduction; built on meta, initialised by init_states.
# Model: benchmarks/titan_8b.py (the benchmark: benchmarks/titan_compare.py --size 8b --config fsdp).
# Checked on CPU with the dry run's model (benchmarks/titan_8b_tiny.py):
#   shardlang apply benchmarks/plans/titan_8b_fsdp.sl benchmarks/titan_8b_tiny.py --nproc 4
shardlang 1

mesh world = auto[dp=auto]

fully_shard on world.dp {
    each tok_embeddings
    unit norm, lm_head (reshard_after_forward=false)
    each layers.*
    mixed_precision(param=bf16, reduce=fp32, cast_forward_inputs=false)
}

init meta with init_states
verify init, init_device, placements, module_states, gradients(steps=1), comms
