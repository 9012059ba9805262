# plans/llama_cp_pipeline.sl — context parallelism inside a pipeline: the blocks split into 2 stages over
# pp, each stage's sequences split over cp (head-tail). Every stage runs the model's own forward on its
# shard of each sequence (the shard's positions given to it), so the activations sent between stages are
# shards too; only the last stage's output is gathered whole, for the loss. FSDP2 reduces over dp*cp.
# Model: examples/llama.py. Run: shardlang apply plans/llama_cp_pipeline.sl examples/llama.py --nproc 4
shardlang 1

mesh world = auto[pp=2, dp=auto, cp=2]

pipeline on world.pp {
    split layers.* into auto
    schedule = 1f1b
    microbatches = 2
}

context_parallel on world.cp {
    each layers.*.attention
}

fully_shard on world[dp*cp] {
    each layers.*
}

verify init, gradients(steps=2, batch=4), module_states, init_device, placements, comms
