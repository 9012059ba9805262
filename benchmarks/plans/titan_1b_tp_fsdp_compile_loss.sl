# benchmarks/plans/titan_1b_tp_fsdp_compile.sl with the loss compiled as well, as torchtitan's CompileConfig
# compiles it by default (components = ["model", "loss"]: torch.compile of its loss function); the
# benchmark trains with `plan.loss(titan_1b.loss)` (titan_compare.py --compile --compile-loss).
# benchmarks/plans/titan_1b_tp_fsdp.sl with each block compiled as torchtitan's CompileConfig(enable=True,
# components=["model"]) compiles it (apply_compile: TransformerBlock.compile(fullgraph=True), after TP and
# before FSDP; the plan lowers `compile` in the same place). `backend`: inductor on the GPUs; the dry run
# on CPU passes aot_eager (-D backend=aot_eager; titan_compare.py --backend).
# torchtitan's own Llama3 1B, tensor parallel 2 with sequence parallelism x FSDP2 over the rest (4 GPUs:
# dp 2 x tp 2).
# TP layout as torchtitan's own (set_llama3_sharding_config with sequence parallelism, its default): the
# embedding split over the vocabulary with torchtitan's own masked lookup (vocab_parallel, from the model
# file: torch's RowwiseParallel cannot take its Embedding, and the weight it shares with lm_head must be
# split alike), its partial sums reduce-scattered onto the sequence; every norm on its sequence shard;
# attention and the feed-forward gather the sequence, their first projections colwise (wqkv holds whole
# key/value groups per rank), their last ones reduce-scatter back; the final norm's output gathered into
# lm_head, colwise, whose logits stay split over the vocabulary for the loss (loss_parallel).
# FSDP2 over dp with torchtitan's units (embedding, final norm and lm_head as one unit kept gathered after
# the forward; each block; the root), bf16 compute and fp32 reduction. Built on meta, initialised as
# torchtitan's trainer does: init_states on the root.
# Model: benchmarks/titan_1b.py (the benchmark: benchmarks/titan_compare.py --config tp_fsdp --compile).
# Checked on CPU with the dry run's model (benchmarks/titan_1b_tiny.py):
#   shardlang apply benchmarks/plans/titan_1b_tp_fsdp_compile.sl benchmarks/titan_1b_tiny.py --nproc 4 -D backend=aot_eager
shardlang 1
param tp = 2  # titan_compare.py --tp 4: TP 4 x FSDP over the rest (8 GPUs: dp 2)
param backend = inductor

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
    unit tok_embeddings, norm, lm_head (reshard_after_forward=false)
    each layers.*
    mixed_precision(param=bf16, reduce=fp32, cast_forward_inputs=false)
}

loss_parallel
compile layers.* (fullgraph=true, backend=$backend)
compile loss (backend=$backend)

init meta with init_states
verify init, init_device, placements, module_states, gradients(steps=1), comms
