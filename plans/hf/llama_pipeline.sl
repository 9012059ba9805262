# plans/hf/llama_pipeline.sl — Hugging Face transformers' LlamaForCausalLM in two pipeline stages, each
# stage's decoder layers sharded with FSDP2 over dp. The model runs unmodified: each stage runs the
# model's own forward with the other stage's modules passed through (rotary tables and the causal mask
# are computed on both stages), docs/language.md §4.5.
# Model: examples/hf_llama.py (needs pip install -e '.[hf]'; tie_word_embeddings=False: a tied
# embedding and head would sit on two stages, SL214).
# Run: shardlang apply plans/hf/llama_pipeline.sl examples/hf_llama.py --nproc 4
shardlang 1

mesh world = auto[pp=2, dp=auto]

pipeline on world.pp {
    split before model.layers.1
    schedule = 1f1b
    microbatches = 4
}

fully_shard on world.dp {
    each model.layers.*
}

init meta
verify init, gradients(steps=2, batch=8), module_states, init_device, placements
