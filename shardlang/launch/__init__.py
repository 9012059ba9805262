"""Launch: local worker processes or torchrun ranks, each running one `shardlang apply` job, results collected."""
