# plans/hf/llama_cp.sl — transformers' LlamaForCausalLM under context parallelism: each sequence split
# over the cp ranks (head-tail balanced); every layer's SDPA attention takes its shard's queries against
# the whole sequence's keys and values, gathered over cp. transformers' model takes `position_ids`,
# which shardlang gives it for the shard, so its rotary embedding sees each token's own position. FSDP2
# shards and reduces over dp*cp.
# Model: examples/hf_llama.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/hf/llama_cp.sl examples/hf_llama.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, cp=2]

context_parallel on world.cp {
    each model.layers.*.self_attn
}

fully_shard on world[dp*cp] {
    each model.layers.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
