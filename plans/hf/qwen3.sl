# plans/hf/qwen3.sl — Hugging Face transformers' Qwen3ForCausalLM built on the meta device: parameters
# on meta, buffers real (the rotary table computed in __init__ survives), every module initialised by
# the model's own _init_weights. FSDP2 over the decoder layers and the root.
# Model: examples/hf_qwen3.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/hf/qwen3.sl examples/hf_qwen3.py --nproc 4
shardlang 1

mesh world = auto[dp=auto]

fully_shard on world.dp {
    each model.layers.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
verify init, gradients(steps=2), init_device, placements
