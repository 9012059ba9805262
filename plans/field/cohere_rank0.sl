# plans/field/cohere_rank0.sl — plans/field/cohere.sl built on rank 0 alone and its weights sent to the
# other ranks (init rank0): the way to start from one copy of real weights. transformers'
# CohereForCausalLM with per-head q/k norms (gathered q, k, v; the MLP split), its output layer tied to
# the embedding (no tp rule for either), FSDP2 over the layers (issue 23's field bed).
# Model: examples/field/cohere.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/field/cohere_rank0.sl examples/field/cohere.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize model.layers.* on world.tp {
    self_attn.{q_proj,k_proj,v_proj} : colwise_gather_output
    self_attn.o_proj                 : rowwise_split_input
    mlp.{gate_proj,up_proj}          : colwise
    mlp.down_proj                    : rowwise
}

fully_shard on world.dp {
    each model.layers.*
}

init rank0
verify init, init_device, placements, module_states, gradients(steps=1)
