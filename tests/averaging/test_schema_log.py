"""The mismatch log says one line per peer, whichever operation met it and however that operation words it."""

import logging

import pytest

from averaging.schema import MismatchLog


def test_one_line_per_peer_across_operations_and_wordings(caplog: pytest.LogCaptureFixture) -> None:
    log = MismatchLog()
    logger = logging.getLogger("test.schema")
    with caplog.at_level(logging.DEBUG, logger="test.schema"):
        assert log.report(b"a", "grad.0: shape [2, 4] there, [1, 4] here", logger, "matchmaking: peer a")
        assert not log.report(b"a", "tensor 0: shape [2, 4] there, [1, 4] here", logger, "state download from a")
        assert not log.report(b"a", "grad.0: shape [2, 4] there, [1, 4] here", logger, "matchmaking: peer a")
        assert log.report(b"b", "grad.0: shape [3, 4] there, [1, 4] here", logger, "matchmaking: peer b")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["matchmaking: peer a: a different model (grad.0: shape [2, 4] there, [1, 4] here); "
                        "not averaging with it",
                        "matchmaking: peer b: a different model (grad.0: shape [3, 4] there, [1, 4] here); "
                        "not averaging with it"]
    assert log.summary() is not None and "and 1 more peers" in log.summary()  # type: ignore[operator]


def test_summary_counts_only_peers_met_after_the_mark() -> None:
    log = MismatchLog()
    logger = logging.getLogger("test.schema")
    log.report(b"a", "x", logger, "matchmaking")
    mark = log.mark()
    assert log.summary(since=mark) is None
    log.report(b"a", "y", logger, "state download")
    assert log.summary(since=mark) == "peer 61 trains a different model: y"
