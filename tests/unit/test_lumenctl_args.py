from __future__ import annotations

from lumenctl.main import _normalize_argv


def test_watch_takes_an_optional_interval() -> None:
    assert _normalize_argv(["status", "--watch"]) == ["status", "--watch", "2.0"]
    assert _normalize_argv(["status", "--watch", "5"]) == ["status", "--watch", "5"]
    assert _normalize_argv(["status", "-w", "-o", "json"]) == ["status", "-w", "2.0", "-o",
                                                               "json"]
