# Seed: test_fsdp_tp_integration.py :: test_fsdp_tp_sync_module_state
# A parameter and a buffer start different on every rank; TP replicates them over tp (from each TP
# group's first rank) and `sync over world.dp` makes the data-parallel replicas agree. (FSDP1's
# sync_module_states=True did this before sharding; here `sync` broadcasts along dp.)
# Model: examples/seeds/per_rank.py.
shardlang 1

mesh world = auto[dp=auto, tp=2]

parallelize on world.tp {
    root : distribute
}

sync over world.dp
verify module_states, placements, init_device
