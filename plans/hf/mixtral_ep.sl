# plans/hf/mixtral_ep.sl — transformers' MixtralForCausalLM with expert parallelism alone: every rank
# keeps num_experts / world of each layer's experts (4 experts: 1 a rank at world 4, 2 at world 2) and
# the whole rest of the model. The ranks share their batch: each routes its slice of the tokens to the
# ranks holding their chosen experts and gathers the results back (two all-to-alls a layer); the router,
# attention, norms and embeddings are whole on every rank and get the same gradients there.
# Model: examples/field/mixtral.py (needs pip install -e '.[hf]').
# Run: shardlang apply plans/hf/mixtral_ep.sl examples/field/mixtral.py --nproc 4
shardlang 1

mesh world = auto[ep=auto]

parallelize on world.ep {
    model.layers.*.mlp.experts : expert_parallel
}
