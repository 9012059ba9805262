"""One check's results on every rank, combined into the row the report prints: the message tells of the
error the table shows."""

from shardlang.verification import combine
from shardlang.verification.outcome import FAIL, PASS, SKIPPED, CheckResult


def _result(status, message, worst, seconds=1.0):
    return CheckResult("gradients", status, message, seconds, {}, worst)


def test_a_failure_is_told_by_the_rank_with_the_worst_error():
    ranks = [
        [_result(PASS, "fine", 0.5)],
        [_result(FAIL, "worst 1.24e+05 x the allowed error (loss): ...", 1.24e5)],
        [_result(FAIL, "worst 5.22e+05 x the allowed error (grad w): ...", 5.22e5, seconds=3.0)],
        [_result(FAIL, "worst 5.22e+05 x the allowed error (grad v): ...", 5.22e5)],
    ]
    (row,) = combine(ranks)
    assert row.status == FAIL and row.worst == 5.22e5 and row.seconds == 3.0
    assert row.message == "rank 2: worst 5.22e+05 x the allowed error (grad w): ..."


def test_skipped_anywhere_is_skipped_and_told_by_the_first_rank_that_skipped():
    ranks = [[_result(PASS, "fine", 0.1)], [_result(SKIPPED, "compared nothing here", None)]]
    (row,) = combine(ranks)
    assert (row.status, row.message, row.worst) == (SKIPPED, "compared nothing here", 0.1)
