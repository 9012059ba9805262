# plans/field/deepseek_v2.sl — transformers' DeepseekV2ForCausalLM (issue 23's field bed): multi-head
# latent attention (MLA) tensor parallel over heads as the model's tp_plan says (q_proj and kv_b_proj
# colwise, o_proj rowwise), the dense MLP and the shared expert colwise/rowwise, the routed experts whole
# on each tp rank (transformers' default grouped matmul) and sharded over dp by FSDP2.
# kv_a_proj_with_mqa computes the latent and the one rotary key every head shares: each tp rank uses
# that key for its own heads only, so its gradient must be summed over tp: the built-in style
# `mla_kv_a_proj(rope=8)` (transformers' own; rope: the config's qk_rope_head_dim).
# Model: examples/field/deepseek_v2.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/field/deepseek_v2.sl examples/field/deepseek_v2.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize model.layers.* on world.tp {
    self_attn.q_proj             : colwise
    self_attn.kv_a_proj_with_mqa : mla_kv_a_proj(rope=8)
    self_attn.kv_b_proj          : colwise
    self_attn.o_proj             : rowwise
    mlp.shared_experts.{gate_proj,up_proj} : colwise
    mlp.shared_experts.down_proj           : rowwise
}
parallelize model.layers.0 on world.tp {       # the first layer is dense (first_k_dense_replace = 1)
    mlp.{gate_proj,up_proj} : colwise
    mlp.down_proj           : rowwise
}

fully_shard on world.dp {
    each model.layers.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
verify init, init_device, placements, module_states, gradients(steps=1)
