# torchtitan's own Llama3 8B (benchmarks/titan_8b.py: untied embedding and output), tensor parallel $tp with sequence
# parallelism x FSDP2 over the rest (8 GPUs: TP 2 x FSDP 4 or, with -D tp=4, TP 4 x FSDP 2), as
# benchmarks/plans/titan_1b_tp_fsdp.sl lays the 1B out.
# FSDP2 with torchtitan's units for an untied model (apply_fsdp_to_decoder's other branch): the embedding
# alone, resharded after the forward; the final norm and lm_head as one unit kept gathered after it;
# each block; the root. bf16 compute, fp32 reduction; built on meta, initialised by init_states.
# Model: benchmarks/titan_8b.py (the benchmark: benchmarks/titan_compare.py --size 8b --config tp_fsdp).
# Checked on CPU with the dry run's model (benchmarks/titan_8b_tiny.py):
#   shardlang apply benchmarks/plans/titan_8b_tp_fsdp.sl benchmarks/titan_8b_tiny.py --nproc 4
shardlang 1
param tp = 2  # titan_compare.py --tp 4: TP 4 x FSDP over the rest (8 GPUs: dp 2)

use benchmarks.titan_1b.vocab_parallel as vocab_parallel

mesh world = auto[dp=auto, tp=$tp]

parallelize on world.tp {
    tok_embeddings : vocab_parallel
    norm           : sequence_parallel
    lm_head        : colwise(input=shard(1), output=shard(-1), local_output=false)
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

loss_parallel
init meta with init_states
verify init, init_device, placements, module_states, gradients(steps=1), comms
