"""What explain predicts for one candidate plan, at the tokens per step the search holds fixed: its peak
memory per GPU, its step time and tokens per second, and the micro-batch and accumulation that fit.

Candidates are explained in worker processes side by side (the search's pool), each worker taking one
after another, the model file loaded there."""

from __future__ import annotations

import math

from attrs import frozen

from ..explain.timing import Hardware

#: The share of a GPU's memory a plan's predicted peak may take by default. The rest is the CUDA context,
#: NCCL's and cuBLAS's buffers and the caching allocator's fragmentation (with expandable segments, as
#: torchtitan's launcher sets them). Calibrated on one H200 (benchmarks/RESULTS.md, issue 42): explain's
#: peak was at or above the measured one on all 13 plans measured (0-5%), and torchtitan's 8B ran at 92.8%
#: of the card; at 0.92 the search had left that layout, its fastest, out.
HEADROOM = 0.95
#: The bytes torch can allocate on each accelerator (explain.timing.GPUS' keys): the card's total memory as
#: torch reports it (`torch.cuda.mem_get_info`, and the "total capacity" of its out-of-memory message),
#: below the vendor's round number (an "80 GB" H100 has 79.1 GiB; a "141 GB" H200 139.8 GiB).
MEMORY = {
    "a100": int(79.1 * 2**30),
    "h100": int(79.1 * 2**30),
    "h200": int(139.8 * 2**30),
    "b200": int(178.3 * 2**30),
}
#: Accumulation steps tried past the first fit, doubling: a candidate that needs more does not fit.
MAX_ACCUMULATION = 64


@frozen
class Prediction:
    """explain's prediction for one candidate: the peak at the micro-batch chosen, the step at the tokens per
    step (micro-batch x accumulation x replicas x sequence), or `why` it has none (does not fit, cannot be
    predicted, does not build)."""

    peak: int | None = None
    seconds: float | None = None
    tokens_per_s: float | None = None
    micro_batch: int | None = None
    accumulation: int | None = None
    why: str | None = None
    fits: bool = False


@frozen
class Task:
    """One candidate to predict, as a worker process takes it."""

    text: str
    replicas: int  # data-parallel replicas: dp x ep
    world: int
    model_file: object  # a runtime.modelfile.ModelFile, pickled by path
    machine: Hardware
    memory: int
    tokens: int  # per step, over every replica
    sequence: int


def predict(task: Task) -> Prediction:
    """The candidate's prediction (in a worker process): explain at the micro-batch the tokens per step
    give each replica; where that does not fit, the largest that does, from the activations' share of the
    peak, with the accumulation that keeps the tokens per step, explained again to confirm it."""
    from ..explain.pictures import size
    from ..frontend.diagnostics import PlanError
    from ..frontend.read import read_source
    from ..frontend.source import Source

    plan, found = read_source(Source("<search>", task.text), None, task.world)
    if plan is None:
        return Prediction(why=f"does not compile: {found[0].message}")
    per_replica, rest = divmod(task.tokens, task.replicas * task.sequence)
    if rest or not per_replica:
        return Prediction(why=f"{task.tokens} tokens do not split into {task.replicas} replicas' sequences")
    model = task.model_file.build_on_meta()
    accumulation = 1
    try:
        while accumulation <= MAX_ACCUMULATION:
            batch = per_replica // accumulation
            explanation = _explain(plan, model, task, batch)
            if explanation.peak is None or explanation.time is None:
                note = "; ".join(explanation.notes) or "explain simulated no step"
                return Prediction(why=f"not predicted: {note}")
            if plan.pipeline is not None:
                return _pipelined(plan, model, task, batch, explanation)
            # After the first micro-batch every gradient is live throughout (Peak.accumulating).
            peak = explanation.peak.bytes if accumulation == 1 else explanation.peak.accumulating()
            if peak <= task.memory:
                seconds = explanation.time.seconds * accumulation
                return Prediction(peak, seconds, task.tokens / seconds, batch, accumulation, fits=True)
            accumulation = _next_accumulation(explanation.peak, batch, per_replica, accumulation, task.memory)
            if accumulation is None:
                return Prediction(peak, why=f"does not fit: {size(peak)} at micro-batch 1")
    except PlanError as e:
        return Prediction(why=f"does not fit the model: {e.diagnostics[0].message}")
    return Prediction(peak, why=f"does not fit within {MAX_ACCUMULATION} accumulation steps")


def _pipelined(plan, model, task: Task, batch: int, first) -> Prediction:
    """A pipelined candidate's prediction from `first` (explain on rank 0, the first stage): its peak the
    higher of the first stage's and the last's (which holds the output layer and the logits), its step the
    slowest pp rank's (explain's). No accumulation: a pipeline's micro-batches already are. Where it
    compiles, not predicted (explain steps its stages eager)."""
    from ..explain.pictures import size
    from ..explain.simulate import PIPELINE_COMPILE

    if PIPELINE_COMPILE in first.notes:
        return Prediction(why=f"not predicted: {PIPELINE_COMPILE.split(':')[0]}")
    last = _explain(plan, model, task, batch, rank=task.world - 1)
    if last.peak is None:
        return Prediction(why=f"not predicted on the last stage: {'; '.join(last.notes) or 'no step'}")
    peak = max(first.peak.bytes, last.peak.bytes)
    if peak > task.memory:
        return Prediction(peak, why=f"does not fit: {size(peak)} (a pipeline's micro-batches are its accumulation)")
    seconds = first.time.seconds
    return Prediction(peak, seconds, task.tokens / seconds, batch, 1, fits=True)


def _explain(plan, model, task: Task, batch: int, rank: int = 0):
    from ..explain.options import ExplainOptions
    from ..explain.simulate import explain

    options = ExplainOptions(task.world, rank, None, True, False, batch, task.machine, None)
    return explain(plan, model, options, task.model_file)


def _next_accumulation(peak, batch: int, per_replica: int, accumulation: int, memory: int) -> int | None:
    """The accumulation whose micro-batch the activations' share of `peak` (at `batch`) says fits, at
    least twice `accumulation`, dividing `per_replica`; None where not even a micro-batch of 1 would."""
    activations = peak.category("activations")
    per_example = activations / batch if batch else 0
    fixed = peak.bytes - activations
    if batch == 1 or per_example <= 0 or fixed >= memory:
        return None
    fitting = max(1, int((memory - fixed) // per_example))
    wanted = max(2 * accumulation, math.ceil(per_replica / fitting))
    while per_replica % wanted and wanted <= per_replica:
        wanted += 1
    return wanted if wanted <= per_replica else None
