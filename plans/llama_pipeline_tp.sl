# plans/llama_pipeline_tp.sl — pipeline parallelism x tensor parallelism: two pipeline ranks, each stage's
# attention and feed-forward split over tp (docs/language.md §4.5).
# Model: examples/llama_pipeline.py. Run: shardlang apply plans/llama_pipeline_tp.sl examples/llama_pipeline.py --nproc 4
# Other schedules: -D schedule=1f1b, or -D schedule=interleaved_1f1b -D per_rank=2.
shardlang 1
param schedule = gpipe
param per_rank = 1

mesh world = auto[pp=2, tp=auto]

pipeline on world.pp {
    split layers.* into auto
    schedule = $schedule
    microbatches = 4
    stages_per_rank = $per_rank
}

# Rules on modules a stage does not hold are skipped on that stage: `output` only runs on the last.
parallelize on world.tp {
    layers.*.attention.{wq,wk,wv}      : colwise
    layers.*.attention.wo              : rowwise
    layers.*.feed_forward.{w1,w3}      : colwise
    layers.*.feed_forward.w2           : rowwise
    output                             : colwise(output=replicate)
}

verify init, gradients(steps=2, batch=8), module_states, init_device, placements, comms
