# plans/hf/gpt2.sl — written by hand: transformers gives GPT-2 no tp_plan, and its projections are
# transformers' Conv1D, which stores its weight [in, out] (colwise splits its columns, dim 1; rowwise
# its rows, dim 0): the *_conv1d styles. c_attn packs [q; k; v] and GPT-2 splits it by the full width,
# so its output is gathered and c_proj splits its input again (as transformers' Phi-3 plan does for
# qkv_proj); the MLP pair is split for real. FSDP2 over the blocks, bf16 compute, built on meta.
# Model: examples/hf_gpt2.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/hf/gpt2.sl examples/hf_gpt2.py --nproc 4
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize transformer.h.* on world.tp {
    attn.c_attn : colwise_conv1d(output=replicate)
    attn.c_proj : rowwise_conv1d(input=replicate)
    mlp.c_fc    : colwise_conv1d
    mlp.c_proj  : rowwise_conv1d
}

fully_shard on world.dp {
    each transformer.h.*
    mixed_precision(param=bf16, reduce=fp32)
}

init meta
