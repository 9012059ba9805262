# plans/field/cohere.sl — transformers' CohereForCausalLM with q/k norms (issue 23's field bed), written
# by hand. Cohere's q_norm and k_norm hold one weight per head ([heads, 16]), so a rank holding half the
# heads cannot apply them: q, k and v are gathered on every rank (colwise_gather_output, as transformers'
# OLMo 2 plan does for its norms) and o_proj splits its input locally; the MLP is split for real (the
# model's tp_plan). The output layer shares the embedding's weight, so neither gets a tp rule: both stay
# whole on each tp rank, in FSDP2's root unit. FSDP2 over the layers, built on meta.
# Model: examples/field/cohere.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/field/cohere.sl examples/field/cohere.py --nproc 4
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

init meta
verify init, init_device, placements, module_states, gradients(steps=1)
