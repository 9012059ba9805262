"""What a check ends with: its status, message and data on one rank (Outcome), and merged over every
rank (CheckResult), with the one-line summary of a report."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attrs import field, frozen

#: How a check ends. `skipped`: it compared nothing (the message says why); `reported`: it measured and
#: shows something but was given nothing to compare it with (comms without expected counts). Neither is
#: a pass. A skip is `moot` where the plan leaves the check nothing to compare (module_states where no
#: tensor has replicas): the run's verdict then rests on the other checks (SPEC §12). A skip for want of
#: what the check needed (no example_input, no prediction, no truth) is not moot: it leaves a request
#: unanswered.
PASS, FAIL, SKIPPED, REPORTED = "pass", "fail", "skipped", "reported"
STATUSES = (PASS, FAIL, SKIPPED, REPORTED)


@frozen
class Outcome:
    """One check on one rank. `worst`: the largest error measured, as a fraction of what was allowed (1.0
    is the limit), where the check has one."""

    status: str = field(validator=lambda _, __, value: _known(value))
    message: str
    data: dict[str, Any] = field(factory=dict)
    worst: float | None = None
    moot: bool = False  # skipped: the plan gives the check nothing to compare (see above)


def _known(status: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"unknown check status {status!r}; expected one of {STATUSES}")


@frozen
class CheckResult:
    check: str
    status: str
    message: str
    seconds: float
    data: dict[str, Any] = field(factory=dict)
    worst: float | None = None
    moot: bool = False  # skipped on every rank that skipped because the plan gave it nothing to compare

    @property
    def ok(self) -> bool | None:
        """True passed, False failed, None neither (skipped or reported)."""
        return True if self.status == PASS else False if self.status == FAIL else None

    def to_json(self) -> dict[str, Any]:
        data = dict(self.data)
        if self.worst is not None:
            data.setdefault("worst_error", self.worst)
        return {
            "check": self.check,
            "status": self.status,
            "ok": self.ok,
            "message": self.message,
            "seconds": round(self.seconds, 4),
            "data": data,
        }


def summary(results: Sequence[CheckResult]) -> str:
    """What happened, in counts: `4 passed, 1 skipped`, `1 failed, 3 passed`, or `no checks ran`."""
    words = {FAIL: "failed", PASS: "passed", SKIPPED: "skipped", REPORTED: "reported"}
    counts = [(sum(r.status == s for r in results), words[s]) for s in (FAIL, PASS, SKIPPED, REPORTED)]
    return ", ".join(f"{n} {word}" for n, word in counts if n) or "no checks ran"
