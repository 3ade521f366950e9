from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import typer
from typer.testing import CliRunner

from lumenctl.main import _normalize_argv, app

# The commands that print data (a table, or -o json/yaml), and so take -o after them.
DATA_COMMANDS = (["status"], ["events"], ["checkpoints"], ["drain"], ["agent"],
                 ["config", "show"], ["config", "get"])


def test_watch_takes_an_optional_interval() -> None:
    assert _normalize_argv(["status", "--watch"]) == ["status", "--watch", "2.0"]
    assert _normalize_argv(["status", "--watch", "5"]) == ["status", "--watch", "5"]
    assert _normalize_argv(["status", "-w", "-o", "json"]) == ["status", "-w", "2.0", "-o",
                                                               "json"]
    assert _normalize_argv(["events", "--follow"]) == ["events", "--follow", "2.0"]


def command(path: list[str]) -> typer.core.TyperCommand:
    found = typer.main.get_command(app)
    for name in path:
        found = found.commands[name]  # type: ignore[attr-defined]
    return found  # type: ignore[return-value]


def test_every_command_that_prints_data_takes_and_shows_output() -> None:
    for path in DATA_COMMANDS:
        options = [p.opts for p in command(path).params]
        assert ["--output", "-o"] in options, path
        shown = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert re.search(r"--output\s+-o\s+\[?<?table\|json\|yaml", shown.stdout), (
            path, shown.stdout)


def complete(line: str) -> list[str]:
    """What bash completion offers for `line` (the protocol the script that
    `lumenctl --install-completion` installs speaks)."""
    words = line.split(" ")
    env = {**os.environ, "_LUMENCTL_COMPLETE": "complete_bash", "COMP_WORDS": line,
           "COMP_CWORD": str(len(words) - 1), "_TYPER_COMPLETE_ARGS": line}
    done = subprocess.run([str(Path(sys.executable).parent / "lumenctl")], env=env,
                          capture_output=True, text=True, timeout=30)
    return done.stdout.split()


def test_output_after_the_command_completes() -> None:
    assert set(complete("lumenctl status -o ")) == {"table", "json", "yaml"}
    assert set(complete("lumenctl config show --output ")) == {"table", "json", "yaml"}


def test_the_old_timeout_names_are_hidden() -> None:
    old = re.compile(r"(?<![\w-])--timeout\b")
    for path in ([], ["drain"]):
        shown = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"}).stdout
        assert not old.search(shown), shown
    assert "--etcd-timeout" in CliRunner().invoke(app, ["--help"]).stdout


def test_the_old_etcd_timeout_name_sets_the_etcd_timeout() -> None:
    group = typer.main.get_command(app)
    for args, expected in ((["--timeout", "0.3"], 0.3), (["--etcd-timeout", "0.4"], 0.4),
                           ([], 2.0)):
        ctx = group.make_context("lumenctl", [*args, "version"])
        with ctx:
            group.invoke(ctx)
        assert ctx.obj.timeout_s == expected, args
    both = CliRunner().invoke(app, ["--timeout", "1", "--etcd-timeout", "2", "version"])
    assert both.exit_code == 2 and "give only --etcd-timeout" in both.stderr


def test_config_names_and_completes_every_setting() -> None:
    from lumend.coordinator.settings import KEYS

    for verb in ("get", "set"):
        shown = CliRunner().invoke(app, ["config", verb, "--help"], env={"COLUMNS": "200"})
        assert all(key in shown.stdout for key in KEYS), shown.stdout
        assert complete(f"lumenctl config {verb} ") == list(KEYS)
    assert complete("lumenctl config set de") == ["decisions"]
