# torchtitan's own Llama3 8B (benchmarks/titan_8b.py, untied, as torchtitan pipelines only untied models):
# pipeline 2 x tensor parallel 2 with sequence parallelism x FSDP2 over the rest (8 GPUs: pp 2 x dp 2 x
# tp 2, issue 43). Each stage holds half the blocks (the first also the embedding, the last the final norm
# and lm_head), 1F1B over 4 micro-batches; TP and FSDP inside a stage as benchmarks/plans/titan_8b_tp_fsdp.sl,
# but for lm_head's logits, gathered for the last stage's loss (no loss_parallel across a pipeline).
# Predicted by benchmarks/node8_explain.py; titan_compare has no pipeline config (torchtitan pipelines
# through its trainer), so nothing times it against torchtitan yet.
shardlang 1
param tp = 2

use benchmarks.titan_1b.vocab_parallel as vocab_parallel

mesh world = auto[pp=2, dp=auto, tp=$tp]

pipeline on world.pp {
    split layers.* into auto
    schedule = 1f1b
    microbatches = 4
}

parallelize on world.tp {
    tok_embeddings : vocab_parallel
    norm           : sequence_parallel
    lm_head        : colwise(input=shard(1), output=replicate)
}

parallelize layers.* on world.tp {
    attention_norm            : sequence_parallel
    attention                 : prepare_input(input=(shard(1), _, _), desired=(replicate, _, _))
    attention.qkv_linear.wqkv : colwise
    attention.wo              : rowwise(output=shard(1))
    ffn_norm                  : sequence_parallel
    feed_forward              : prepare_input(input=shard(1), desired=replicate)
    feed_forward.{w1,w3}      : colwise
    feed_forward.w2           : rowwise(output=shard(1))
}

fully_shard on world.dp {
    each tok_embeddings
    unit norm, lm_head (reshard_after_forward=false)
    each layers.*
    mixed_precision(param=bf16, reduce=fp32, cast_forward_inputs=false)
}

init meta with init_states
verify init, init_device, placements, module_states, gradients(steps=1), comms
