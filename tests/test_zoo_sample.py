"""A fixed sample of the zoo (issue 41; `python -m benchmarks.zoo` sweeps every family): dense, composite,
mixture-of-experts, hybrid, encoder-decoder and encoder families of transformers, built tiny, and the three
whose starters the zoo found wrong (Apertus: init meta leaves xIELU's alpha unwritten; FNet: no bf16 FFT;
LED: a float64 truth that is not finite). For each, `shardlang init` writes the starter plan and lints it with
the simulated step (no error; a warning such as SL203's uneven shards allowed), and the plan passes every check at world 2 on a warm gloo pool: lint agrees with
apply. Bamba (Mamba2 and attention) is swept, not sampled: its Mamba2 reference kernel takes five minutes
of CI's two cores; Jamba stands for the hybrids. Skipped without transformers: pip install -e '.[hf]'."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from benchmarks.zoo.build import write_model_file  # noqa: E402
from shardlang.launch.job import Job, run  # noqa: E402

SAMPLE = {
    "llama": "dense",
    "qwen3": "dense",
    "gpt2": "dense, Conv1D",
    "gemma3": "composite: a SigLIP tower with its own _init_weights",
    "qwen3_moe": "experts",
    "mixtral": "experts",
    "granitemoe": "experts",
    "jamba": "hybrid: Mamba and attention, experts",
    "bart": "encoder-decoder",
    "t5": "encoder-decoder",
    "bert": "encoder",
    "modernbert": "encoder",
    "apertus": "init rank0: init meta leaves xIELU's alpha unwritten (SL224)",
    "fnet": "no mixed_precision: no bf16 FFT",
    "led": "a float64 truth that is not finite",
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(SAMPLE))
def test_the_starter_plan_lints_clean_and_passes_every_check(name, pools, tmp_path, capsys):
    import shardlang
    from shardlang.cli.main import main

    model = write_model_file(name, tmp_path / f"{name}.py")
    plan = tmp_path / f"{name}.sl"
    assert main(["init", str(model), "--no-check", "-o", str(plan)]) == 0  # 1 on any lint error
    said = capsys.readouterr().out
    assert "linted at world 2: " in said and "not applied (--no-check)" in said, said
    report = pools(2).run(run, Job(str(plan), {}, str(model), None, shardlang.load(plan).checks))[0]
    failed = {c.check: c.message for c in report.checks if c.status == "fail"}
    assert report.ok and not failed, (SAMPLE[name], failed, plan.read_text())
