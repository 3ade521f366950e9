"""When a test that ran real processes fails, show what they logged.

CI keeps only the tail of the suite's output and none of its files: a failed cluster test
said "connection refused" and nothing about which process had gone or why. Every log file
under the failed test's tmp_path (lumend's, its engines', etcd's) gives its warnings and
errors to the report (a section per file, after the traceback) and its last few to the
terminal summary, printed just above the short summary that CI's tail always shows."""

from __future__ import annotations

import re
from collections.abc import Generator
from pathlib import Path

import pytest

NOTABLE = re.compile(r" (WARNING|ERROR|CRITICAL) |Traceback|Error:|exited with|killed")
SECTION_LINES = 60  # per log file, in the failure's report
SUMMARY_LINES = 12  # per failed test, in the terminal summary, the latest first by time
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d+")
LINE_CHARS = 240

_summaries: list[tuple[str, list[str]]] = []


def notable_lines(path: Path, limit: int) -> list[str]:
    """The last `limit` lines of `path` that report a problem, each cut to LINE_CHARS."""
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return [f"(unreadable: {e})"]
    lines = [line[:LINE_CHARS] for line in text.splitlines()
             if NOTABLE.search(line) and "aiohttp.access" not in line]
    return lines[-limit:]


def logged_at(entry: str) -> str:
    """The timestamp of a "file: line" entry, "" for a line that has none (sorted first)."""
    found = STAMP.search(entry.split(": ", 1)[-1])
    return found.group(0) if found else ""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport,
                                                                         pytest.TestReport]:
    report = yield
    if not report.failed or call.when == "teardown":
        return report
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if not isinstance(tmp, Path) or not tmp.is_dir():
        return report
    summary: list[str] = []
    for log in sorted(tmp.rglob("*.log")):
        lines = notable_lines(log, SECTION_LINES)
        if not lines:
            continue
        name = str(log.relative_to(tmp))
        report.sections.append((f"notable lines of {name}", "\n".join(lines)))
        summary.extend(f"{name}: {line}" for line in lines)
    if summary:
        summary.sort(key=logged_at)
        _summaries.append((item.nodeid, summary[-SUMMARY_LINES:]))
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for nodeid, lines in _summaries:
        terminalreporter.write_line(f"last problems logged under {nodeid}'s tmp_path:")
        for line in lines:
            terminalreporter.write_line("  " + line)
