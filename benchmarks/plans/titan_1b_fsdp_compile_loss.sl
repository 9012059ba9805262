# benchmarks/plans/titan_1b_fsdp_compile.sl with the loss compiled as well, as torchtitan's CompileConfig
# compiles it by default (components = ["model", "loss"]: torch.compile of its loss function); the
# benchmark trains with `plan.loss(titan_1b.loss)` (titan_compare.py --compile --compile-loss).
# benchmarks/plans/titan_1b_fsdp.sl with each block compiled as torchtitan's CompileConfig(enable=True,
# components=["model"]) compiles it (apply_compile: TransformerBlock.compile(fullgraph=True), after TP and
# before FSDP; the plan lowers `compile` in the same place). `backend`: inductor on the GPUs; the dry run
# on CPU passes aot_eager (-D backend=aot_eager; titan_compare.py --backend).
# torchtitan's own Llama3 1B, FSDP2 over every GPU, with the units torchtitan's apply_fsdp_to_decoder
# makes for a model whose embedding and output layer share one weight (the 1B's enable_weight_tying): the
# embedding, the final norm and lm_head as one unit (the tied weight gathered once), kept gathered after the
# forward since the backward starts there; each block a unit; then the root. bf16 parameters, fp32
# gradient reduction, forward inputs not cast (torchtitan's MixedPrecisionPolicy). Built on meta,
# materialised on the GPUs and initialised as torchtitan's trainer does: init_states on the root.
# Model: benchmarks/titan_1b.py (the benchmark: benchmarks/titan_compare.py --config fsdp --compile).
# Checked on CPU with the dry run's model (benchmarks/titan_1b_tiny.py):
#   shardlang apply benchmarks/plans/titan_1b_fsdp_compile.sl benchmarks/titan_1b_tiny.py --nproc 2 -D backend=aot_eager
shardlang 1
param backend = inductor

mesh world = auto[dp=auto]

fully_shard on world.dp {
    unit tok_embeddings, norm, lm_head (reshard_after_forward=false)
    each layers.*
    mixed_precision(param=bf16, reduce=fp32, cast_forward_inputs=false)
}

compile layers.* (fullgraph=true, backend=$backend)
compile loss (backend=$backend)

init meta with init_states
verify init, init_device, placements, module_states, gradients(steps=1), comms
