"""`shardlang search`: the plan explain predicts fastest among those that fit, at a fixed number of tokens
per step (candidates.py: what is varied; ranking.py: what explain predicts for each).

The search is two rounds (a third where nothing fits), so that it stays within what explain can simulate
in minutes:
1. every layout the model takes (candidates.layouts, pipelines included where the model can be cut; one
   beyond plain data parallelism first settled by lint's simulated step, candidates.settled) with each
   activation-checkpointing choice, FSDP resharding after forward and no compile;
2. for the best `refine` layouts-and-checkpointing of round 1 that fit, the same without resharding after
   forward, compiled, and both;
3. only where nothing fits: for the `refine` layouts nearest to fitting, the plan of each with the smallest
   peak, with FSDP's CPU offload (`offload = cpu`: parameters, gradients and optimizer states in host
   memory, copied in and out each step).
A choice that round 1 ranked low is not tried with round 2's options: the search says how many plans it
weighed, and the header of the plan it writes lists the runners-up."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

from attrs import frozen

from .candidates import CHECKPOINTING, Candidate, Settling, base_plans, settled, with_options
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
    sequences = settings.tokens // settings.sequence
    bases = base_plans(model, settings.world, settings.gpus_per_node, name, order, sequences)
    plain = [b for b in bases if all(size == 1 for _, size in b.layout.extra())]
    jobs = min(settings.jobs or min(8, os.cpu_count() or 1), max(len(bases) * len(CHECKPOINTING), 1))
    counter = _Counter(done, len(bases) * len(CHECKPOINTING) + settings.refine * len(REFINEMENTS))
    seen: set[str] = set()
    # One pool for everything: each worker explains candidate after candidate, so torch, the model file and
    # what explain imports load once a worker (about 12 s of a candidate's 20 on one core for torchtitan's
    # 1B), not once a candidate. The layouts beyond plain data parallelism are settled there first (lint
    # with the step, what cannot run left out), while the plain ones are already being explained.
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        settling = [
            pool.submit(settled, Settling(b, model_file, settings.world, name, order)) for b in bases if b not in plain
        ]
        first = {}
        for base in plain:
            first |= _submitted(pool, model_file, _options(base, model, seen), settings)
        kept = list(plain)
        for future in as_completed(settling):
            base = future.result()
            if base is None:  # a dim of its layout did not survive the step: that layout is no candidate
                counter.total -= len(CHECKPOINTING)
                continue
            kept.append(base)
            first |= _submitted(pool, model_file, _options(base, model, seen), settings)
        weighed = _gathered(first, counter)
        best = [r.candidate for r in _ranked(weighed) if r.prediction.fits][: settings.refine]
        by_layout = {b.layout: b for b in kept}
        second = [
            with_options(by_layout[c.layout], model, c.checkpoint, reshard, compiled)
            for c in best
            for reshard, compiled in REFINEMENTS
        ]
        second = _distinct(second, seen)
        counter.total = counter.finished + len(second)
        weighed += _gathered(_submitted(pool, model_file, second, settings), counter)
        if not any(r.prediction.fits for r in weighed):
            third = _offloaded(weighed, by_layout, model, settings.refine, seen)
            counter.total = counter.finished + len(third)
            weighed += _gathered(_submitted(pool, model_file, third, settings), counter)
    return _ranked(weighed)


def _offloaded(weighed: Sequence[Ranked], by_layout: dict, model, refine: int, seen: set[str]) -> list[Candidate]:
    """Round 3: for the `refine` layouts whose plans came nearest to fitting, the plan with the smallest
    predicted peak, resharding after forward (offloading is for memory) and offloading to the CPU. One a
    layout: the layouts differ most in speed, and offloading shrinks every plan's peak alike."""
    smallest: dict = {}
    for r in sorted((r for r in weighed if r.prediction.peak is not None), key=lambda r: r.prediction.peak):
        smallest.setdefault(r.candidate.layout, r.candidate)
    offloaded = [
        with_options(by_layout[c.layout], model, c.checkpoint, True, c.compiled, offload=True)
        for c in list(smallest.values())[:refine]
    ]
    return _distinct(offloaded, seen)


def _options(base: Candidate, model, seen: set[str]) -> list[Candidate]:
    """Round 1's candidates of a layout: each activation-checkpointing choice, resharding, not compiled."""
    return _distinct([with_options(base, model, checkpoint, True, False) for checkpoint in CHECKPOINTING], seen)


class _Counter:
    """Predictions finished out of how many the search expects, told to `done` after each."""

    def __init__(self, done: Callable[[int, int], None] | None, total: int):
        self.done, self.total, self.finished = done, total, 0

    def tick(self) -> None:
        self.finished += 1
        if self.done is not None:
            self.done(self.finished, max(self.total, self.finished))


def _distinct(candidates: list[Candidate], seen: set[str]) -> list[Candidate]:
    """The candidates whose plan differs from every earlier one's (a model without a stack of blocks has
    nothing to checkpoint or compile: those options write the same plan); `seen` gains their texts."""
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


def _submitted(pool, model_file, candidates: list[Candidate], settings: Settings) -> dict:
    """Each candidate handed to the pool's workers to predict: {future: candidate}."""
    return {
        pool.submit(
            predict,
            Task(
                c.text,
                c.layout.dp * c.layout.ep,
                settings.world,
                model_file,
                settings.machine,
                settings.memory,
                settings.tokens,
                settings.sequence,
            ),
        ): c
        for c in candidates
    }


def _gathered(futures: dict, counter: _Counter) -> list[Ranked]:
    """The predictions of `futures` ({future: candidate}) as they finish, in the order submitted."""
    predictions = {}
    for future in as_completed(futures):
        predictions[future] = future.result()
        counter.tick()
    return [Ranked(candidate, predictions[future]) for future, candidate in futures.items()]
