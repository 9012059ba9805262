"""The zoo (issue 41): every family transformers maps to a causal, seq2seq or masked language model, built
tiny from its config class and swept through `shardlang init`, `lint` and `apply`, one family per process.

    python -m benchmarks.zoo [--mode plain|tp|ep|cp|pp ...] [--only FAMILY ...] [--shard I/N] [--timeout S]
                             [--results FILE] [--table] [--built]

Sampling families by hand found a new class of failure each round; the sweep stops sampling. Each family
gets a generated model file (benchmarks/.zoo/<family>.py, importing `model_file` from benchmarks.zoo), then per mode:
`init MODEL --no-check -o PLAN` (the starter plan, statically linted), `lint PLAN MODEL --world W --format
json` (lint's verdict, with its simulated step) and `apply PLAN MODEL --nproc W --json` (apply's verdict),
each in its own process with a timeout. One JSON line per (family, mode) goes to the results file, which
makes the sweep resumable: a (family, mode) already there is skipped. `--table` prints the summary: counts
by outcome and the failures grouped by class (the first diagnostic code and a short normalised message).

Built tiny: 2 layers, hidden 64, 4 heads (2 kv heads), head_dim 16, intermediate 128, vocab 128, 4 experts
(top 2, width 32) where it has experts, no special token ids, float32, SDPA attention where it has it. The
unsharded model runs one forward and loss here before any shardlang command: a family whose own model
cannot do that is "not built", with why, and is no verdict on shardlang (`--built`: only that, for every
family).

Modules: build.py (the families, the shrink, the model files' functions), verdicts.py (what each
command said, and a record judged), __main__.py (the sweep, the table).
"""

from benchmarks.zoo.build import (  # noqa: F401
    KINDS,
    SEQ,
    VOCAB,
    Family,
    applies,
    build,
    example_input,
    families,
    family,
    is_moe,
    model_file,
    probe,
)
from benchmarks.zoo.verdicts import judged, normalised  # noqa: F401
