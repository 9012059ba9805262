"""`shardlang search`: the plan explain predicts fastest among those that fit, at a fixed number of tokens
per step (candidates.py: what is varied; ranking.py: what explain predicts for each).

The search is two rounds, so that it stays within what explain can simulate in minutes:
1. every layout the model takes (candidates.layouts) with each activation-checkpointing choice, FSDP
   resharding after forward and no compile;
2. for the best `refine` layouts-and-checkpointing of round 1 that fit, the same without resharding after
   forward, compiled, and both.
A choice that round 1 ranked low is not tried with round 2's options: the search says how many plans it
weighed, and the header of the plan it writes lists the runners-up."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

from attrs import frozen

from .candidates import CHECKPOINTING, Candidate, base_plans, with_options
from .ranking import Prediction, Task, predict

#: Round 2's options for each of round 1's best: (reshard_after_forward, compiled).
REFINEMENTS = ((False, False), (True, True), (False, True))


@frozen
class Ranked:
    """A candidate and explain's prediction for it."""

    candidate: Candidate
    prediction: Prediction


@frozen
class Settings:
    """What the search holds fixed: the world, the machine (explain.timing.Hardware), the memory a GPU's
    peak may take, the tokens per step over every replica, the sequence length the model file's
    example_input gives, and how many worker processes explain the candidates."""

    world: int
    machine: object
    memory: int
    tokens: int
    sequence: int
    gpus_per_node: int = 8
    jobs: int = 0  # 0: one per CPU core, at most 8
    refine: int = 3


def search(
    model_file, model, settings: Settings, name: str, order=None, done: Callable[[int, int], None] | None = None
) -> list[Ranked]:
    """Every candidate weighed, best first (the fitting ones by predicted tokens per second, then those that
    do not fit or cannot be predicted). `done(finished, total)` after each prediction (a progress bar)."""
    bases = base_plans(model, settings.world, settings.gpus_per_node, name, order)
    first = _distinct([with_options(b, model, checkpoint, True, False) for b in bases for checkpoint in CHECKPOINTING])
    jobs = min(settings.jobs or min(8, os.cpu_count() or 1), len(first))
    # One pool for both rounds: each worker explains candidate after candidate, so torch, the model file and
    # what explain imports load once a worker (about 12 s of a candidate's 20 on one core for torchtitan's
    # 1B), not once a candidate.
    with ProcessPoolExecutor(max(jobs, 1), mp_context=get_context("spawn")) as pool:
        total = len(first) + settings.refine * len(REFINEMENTS)
        weighed = _predicted(pool, model_file, first, settings, done, 0, total)
        best = [r.candidate for r in _ranked(weighed) if r.prediction.fits][: settings.refine]
        base = {b.layout: b for b in bases}
        second = [
            with_options(base[c.layout], model, c.checkpoint, reshard, compiled)
            for c in best
            for reshard, compiled in REFINEMENTS
        ]
        second = _distinct(second, {c.text for c in first})
        weighed += _predicted(pool, model_file, second, settings, done, len(first), len(first) + len(second))
    return _ranked(weighed)


def _distinct(candidates: list[Candidate], seen: set[str] | None = None) -> list[Candidate]:
    """The candidates whose plan differs from every earlier one's (a model without a stack of blocks has
    nothing to checkpoint or compile: those options write the same plan)."""
    seen = set(seen or ())
    kept = []
    for candidate in candidates:
        if candidate.text not in seen:
            seen.add(candidate.text)
            kept.append(candidate)
    return kept


def _ranked(weighed: Sequence[Ranked]) -> list[Ranked]:
    def key(r: Ranked):
        p = r.prediction
        return (not p.fits, -(p.tokens_per_s or 0.0), p.peak if p.peak is not None else float("inf"))

    return sorted(weighed, key=key)


def _predicted(
    pool, model_file, candidates: list[Candidate], settings: Settings, done, before: int, total: int
) -> list[Ranked]:
    """Each candidate's prediction, explained by the `pool`'s worker processes side by side."""
    tasks = [
        Task(
            i,
            c.text,
            c.layout.dp * c.layout.ep,
            settings.world,
            model_file,
            settings.machine,
            settings.memory,
            settings.tokens,
            settings.sequence,
        )
        for i, c in enumerate(candidates)
    ]
    predictions: dict[int, Prediction] = {}
    for future in as_completed([pool.submit(predict, task) for task in tasks]):
        prediction = future.result()
        predictions[prediction.index] = prediction
        if done is not None:
            done(before + len(predictions), total)
    return [Ranked(c, predictions[i]) for i, c in enumerate(candidates)]
