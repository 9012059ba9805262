# benchmarks/plans/mixtral_ep.sl — the plan benchmarks/ep_compare.py times: plans/hf/mixtral_ep.sl's rule
# on its 1.2B Mixtral, every GPU one rank of ep.
shardlang 1

mesh world = auto[ep=auto]

parallelize on world.ep {
    model.layers.*.mlp.experts : expert_parallel
}
