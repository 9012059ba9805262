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


def _localised(statements):
    where = {"module": "model.layers.0.mlp.gate", "class": "Router", "call": 1, "what": "weight's gradient"}
    data = {"localised": {**where, "statements": statements}}
    return CheckResult("gradients", FAIL, "worst 3 x the allowed error (grad w)", 1.0, data, 3.0)


def test_a_localised_module_with_its_own_rule_is_not_said_to_have_none():
    """The SL400 at the localised module: where its own rule is the one statement, that rule is the place and
    nothing says 'no plan statement governs this module itself' (issue 39: a router's rule under EP)."""
    from shardlang.launch.job import _failure

    rule = {"what": "its rule", "file": "p.sl", "line": 7, "col": 5, "end_line": 7, "end_col": 40, "text": "gate : x"}
    _, at_rule = _failure(_localised([rule]), ())
    assert at_rule.span.line == 7 and at_rule.help == ()
    _, nowhere = _failure(_localised([]), ())
    assert nowhere.span is None and "no plan statement governs this module itself" in nowhere.help[0]


def test_fsdp_view_warnings_of_every_unit_are_one_line_naming_their_classes():
    """FSDP2 warns once per unit that returns a view, naming the unit's classes; the report said it once per
    class (issue 40 item 6: 8 lines of one warning). One line, the classes named, the count kept."""
    import warnings

    from shardlang.launch.job import _unique

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for classes in ("LlamaDecoderLayer", "LlamaModel", "LlamaDecoderLayer", "Embedding, Linear"):
            warnings.warn(
                f"FSDP2-wrapped module ({classes}) returned a view tensor. Use .clone().", UserWarning, stacklevel=1
            )
        warnings.warn("something else", UserWarning, stacklevel=1)
    view, other = _unique(caught)
    assert "FSDP2-wrapped modules returned a view tensor. Use .clone()." in view, view
    assert view.endswith("[units of Embedding, Linear, LlamaDecoderLayer, LlamaModel] [4x over all ranks]"), view
    assert other.startswith("UserWarning: something else"), other
