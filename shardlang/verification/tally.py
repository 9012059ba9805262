"""The gradients check's bookkeeping: each tensor compared with the truth (a loss, a gradient, the ranks'
copies of a gradient, an optimizer update) under the tolerance reference.py sets, the worst error per
tensor over the steps, and the failures in the words the report uses."""

from __future__ import annotations

import math

import torch

from .reference import allowed_error, rounding_error, worst_slice

#: Optimizer updates are computed elementwise from identical gradients: they may differ by this fraction
#: of the largest update in the tensor, plus a few units in the last place of the parameter.
UPDATE_RTOL = 1e-3


class Tally:
    """Failures so far, and the worst (error, allowed, error / allowed) per tensor over the steps."""

    def __init__(self):
        self.failures: list[str] = []
        self.worst: dict[str, tuple[float, float, float]] = {}
        self._failing: list[str] = []

    def failing_params(self) -> list[str]:
        return list(self._failing)

    def _note(self, key: str, error: float, allowed: float) -> float:
        ratio = error / allowed if allowed > 0 else (0.0 if error == 0 else math.inf)
        if key not in self.worst or ratio > self.worst[key][2]:
            self.worst[key] = (error, allowed, ratio)
        return ratio

    def compare(self, what, key, got, truth, same, scale: float, fixed, floor: float = 0.0, own: float = 0.0) -> None:
        """A loss or a gradient: `got` against the truth, allowed K times the same-precision reference's
        error (or the fixed rule), plus `floor` (the loss: its relative share of the gradients' rounding);
        `own` is the truth's own measured error (a float32 truth's; 0 for float64)."""
        got, truth = got.detach().double(), truth.detach().to(got.device).double()
        if got.shape != truth.shape:
            self.failures.append(f"{what}: shape {tuple(got.shape)}, expected {tuple(truth.shape)}")
            self._note(key, math.inf, 1.0)
            return
        error = float((got - truth).norm())
        allowed = allowed_error(truth, same, scale, fixed, own) + (floor if fixed is None else 0.0)
        ratio = self._note(key, error, allowed)
        if not bool(torch.isfinite(got).all()):
            self.failures.append(f"{what}: not finite")
        elif ratio > 1.0:
            truths = f", the float32 truth's own {own:.3g}" if own else ""
            self.failures.append(
                f"{what}: error {error:.3g} is {ratio:.3g} x the allowed {allowed:.3g} "
                f"(the reference's own rounding error {rounding_error(truth, same):.3g}{truths})"
            )
        else:
            return
        if key.startswith("grad "):
            self._failing.append(key.removeprefix("grad "))

    def compare_ranks(self, what, key, spread, truth, same, scale: float, own: float = 0.0) -> None:
        """A gradient every rank holds alike (reduced, or made whole by `full`): its `spread` over the ranks
        (largest minus smallest value, elementwise), the whole tensor and slice by slice (a fault confined
        to a few rows hides in the whole tensor's rounding), against what it may differ from the truth by.
        Ranks of one replica route tokens alike, so unlike the truth this cannot differ by a token that
        rounding sent to another expert."""
        truth = truth.detach().to(spread.device).double()
        whole = float(spread.norm())
        allowed = allowed_error(truth, same, scale, None, own)
        part = worst_slice(spread, truth, same, scale, own)
        ratio = self._note(key, whole, allowed)
        if part is not None:
            self._note(key, part.error, part.allowed)
        if ratio > 1.0:
            found = f"by {whole:.3g}, {ratio:.3g} x the allowed {allowed:.3g}"
        elif part is not None and part.over:
            found = part.describe()
        else:
            return
        self.failures.append(
            f"{what}: the ranks hold different gradients ({found}), where every rank's should be the same "
            "after the reductions: a reduction over the ranks that replicate it is missing"
        )
        self._failing.append(key.removeprefix("grad "))

    def compare_update(self, what, key, got, want, before) -> None:
        """An updated parameter, elementwise: both optimizers stepped from the same gradients, so they may
        differ by UPDATE_RTOL of the tensor's largest update plus four units in the last place."""
        if got.shape != want.shape:
            self.failures.append(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            self._note(key, math.inf, 1.0)
            return
        eps = torch.finfo(want.dtype).eps
        got, want = got.detach().double(), want.detach().to(got.device).double()
        step = float((want - before.to(want.device).double()).abs().max()) if want.numel() else 0.0
        allowed = (UPDATE_RTOL * step + 4 * eps * want.abs()).clamp_min(torch.finfo(torch.float64).tiny)
        diff = (got - want).abs()
        over = diff > allowed
        ratios = diff / allowed
        at = int(ratios.argmax()) if ratios.numel() else 0
        if ratios.numel():
            self._note(key, float(diff.flatten()[at]), float(allowed.flatten()[at]))
        if not bool(torch.isfinite(got).all()):
            self.failures.append(f"{what}: not finite")
        elif bool(over.any()):
            self.failures.append(
                f"{what}: {int(over.sum())} of {over.numel()} values differ from the reference optimizer's, "
                f"given the same gradients (max difference {float(diff.max()):.3g})"
            )
