"""The gateway's admission log line, read back by lumenctl.admissions (the same text both
ways: the line is produced by the gateway's own function, not retyped here)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lumenctl.admissions import AdmissionLine, first_admissions, parse_admission, read_admissions
from lumend.gateway.server import log_admission


def logged_line(caplog: pytest.LogCaptureFixture, *args: object) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lumend.gateway"):
        log_admission(*args)  # type: ignore[arg-type]
    [record] = caplog.records
    return f"2026-12-07 10:00:00 INFO lumend.gateway: {record.getMessage()}"


def test_every_form_of_the_line_reads_back(caplog: pytest.LogCaptureFixture) -> None:
    reason = "coordinator epoch 3: queue 2, the shortest; no checkpoint (no holder has budget)"
    cases = [
        (("cmpl-a", set(), "node-1-w0", "node-2-w0", reason),
         AdmissionLine("n", "cmpl-a", "node-1-w0", "node-2-w0", (), reason)),
        (("cmpl-b", {"node-2-w0", "node-1-w0"}, "node-3-w0", None, "this gateway's own view"),
         AdmissionLine("n", "cmpl-b", "node-3-w0", None, ("node-1-w0", "node-2-w0"),
                       "this gateway's own view")),
        (("chatcmpl-c", set(), None, None, "coordinator epoch 1: no serving worker"),
         AdmissionLine("n", "chatcmpl-c", None, None, (),
                       "coordinator epoch 1: no serving worker")),
    ]
    for args, expected in cases:
        assert parse_admission("n", logged_line(caplog, *args)) == expected
    # Negative control: the recovery routing lines are not admissions.
    assert parse_admission("n", "INFO lumend.gateway: recovery routing (coordinator epoch 3): "
                                "resume on node-2-w0") is None


def test_first_admissions_skip_retries_and_read_every_log(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    one, two = tmp_path / "node-1.log", tmp_path / "node-2.log"
    one.write_text("\n".join([
        logged_line(caplog, "r1", {"w0"}, "w1", None, "retry logged first"),
        logged_line(caplog, "r1", set(), "w0", "w1", "first"),
        "a line that is not an admission",
        logged_line(caplog, "r1", set(), "w1", None, "a second one without exclusions"),
    ]) + "\n")
    two.write_text(logged_line(caplog, "r2", set(), "w1", "w0", "other node") + "\n")
    lines = read_admissions([("node-1", one), ("node-2", two)])
    assert len(lines) == 4
    first = first_admissions(lines)
    assert {rid: (x.node, x.worker, x.decided_by) for rid, x in first.items()} == {
        "r1": ("node-1", "w0", "first"), "r2": ("node-2", "w1", "other node")}
