# plans/llama_pipeline.sl — pipeline parallelism x FSDP2: two pipeline ranks, each stage's blocks sharded
# over dp (docs/language.md §4.5).
# Model: examples/llama_pipeline.py. Run: shardlang apply plans/llama_pipeline.sl examples/llama_pipeline.py --nproc 4
# Other schedules: -D schedule=gpipe, or -D schedule=interleaved_1f1b -D per_rank=2 (four stages of one block).
shardlang 1
param schedule = 1f1b
param per_rank = 1

mesh world = auto[pp=2, dp=auto]

pipeline on world.pp {
    split layers.* into auto       # the stack's blocks in pp x stages_per_rank stages of equal size
    schedule = $schedule
    microbatches = 4
    stages_per_rank = $per_rank
}

# Inside each stage, as for a whole model: a unit per block, the stage's root (embeddings, norm, output).
fully_shard on world.dp {
    each layers.*
    mixed_precision(param=fp32, reduce=fp32)
}

verify init, gradients(steps=2, batch=8), module_states, init_device, placements, comms
