from __future__ import annotations

from lumenctl.main import _normalize_argv


def test_watch_takes_an_optional_interval() -> None:
    assert _normalize_argv(["status", "--watch"]) == ["status", "--watch", "2.0"]
    assert _normalize_argv(["status", "--watch", "5"]) == ["status", "--watch", "5"]
    assert _normalize_argv(["status", "-w", "-o", "json"]) == ["-o", "json", "status", "-w",
                                                               "2.0"]
    assert _normalize_argv(["events", "--follow"]) == ["events", "--follow", "2.0"]


def test_output_after_the_command_moves_in_front_of_it() -> None:
    assert _normalize_argv(["status", "-o", "json"]) == ["-o", "json", "status"]
    assert _normalize_argv(["status", "--output=yaml"]) == ["--output=yaml", "status"]
    assert _normalize_argv(["status", "-ojson"]) == ["-ojson", "status"]
    assert _normalize_argv(["--cluster", "prod", "config", "get", "alpha", "-o", "json"]) == [
        "--cluster", "prod", "-o", "json", "config", "get", "alpha"]
    # Already in front: unchanged. A global option's value is not taken for the command.
    assert _normalize_argv(["-o", "json", "status"]) == ["-o", "json", "status"]
    assert _normalize_argv(["--config", "/x.toml", "events", "-o", "yaml"]) == [
        "--config", "/x.toml", "-o", "yaml", "events"]
    # `sim` has an -o of its own; after `--` nothing is moved.
    assert _normalize_argv(["sim", "-o", "json"]) == ["sim", "-o", "json"]
    assert _normalize_argv(["drain", "--reason", "x", "--", "-o"]) == [
        "drain", "--reason", "x", "--", "-o"]
