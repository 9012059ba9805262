# plans/hf/llama.sl — Hugging Face transformers' LlamaForCausalLM: tensor parallel exactly as the
# model's own base_model_tp_plan says (q/k/v and gate/up colwise, o and down rowwise), FSDP2 over the
# decoder layers and the root.
# Model: examples/hf_llama.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/hf/llama.sl examples/hf_llama.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize model.layers.* on world.tp {
    self_attn.{q_proj,k_proj,v_proj} : colwise
    self_attn.o_proj                 : rowwise
    mlp.{gate_proj,up_proj}          : colwise
    mlp.down_proj                    : rowwise
}

fully_shard on world.dp {
    each model.layers.*
}

init cpu
verify init, gradients(steps=2), module_states, init_device, placements
