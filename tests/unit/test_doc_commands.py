"""Every `lumenctl ...` and `lumend ...` command line that README.md and docs/*.md show (in
code blocks and in inline code) parses with the real argument parsers, so the docs and the
CLI cannot drift apart.

A line is parsed as the program parses it (lumenctl's own argv normalisation first: -o
after the command, --watch without SECONDS), without running anything. Synopsis notation is
understood: `[...]` is optional (checked without and with every optional part), `a|b` are
alternatives (each checked), and an upper-case word (NODE, SECS, P,...) is a placeholder.
"""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from lumenctl.main import _normalize_argv
from lumenctl.main import app as lumenctl_app
from lumend.cli import app as lumend_app

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PROGRAMS = {"lumenctl": lumenctl_app, "lumend": lumend_app}
# A program name where a command starts: at the start, after an environment assignment,
# a shell operator or a path (/opt/lumen/venv/bin/lumend).
COMMAND = re.compile(r"(?:^|(?<=[\s/(]))(lumenctl|lumend)(?=\s|$)")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(?:[,.]+[A-Z0-9_.,]*)*$")
SHELL_OPERATORS = re.compile(r"\s(?:\|\||&&|\||;|>|2>&1|<)\s")


def shown_commands() -> Iterator[tuple[str, str, bool]]:
    """(where, command text, whether it is inline code) for each lumenctl/lumend command
    the docs show."""
    for doc in DOCS:
        in_block = False
        continued = ""
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            where = f"{doc.relative_to(REPO)}:{number}"
            if line.lstrip().startswith("```"):
                in_block = not in_block
                continue
            if in_block:
                text = continued + line
                if text.endswith("\\"):
                    continued = text[:-1] + " "
                    continue
                continued = ""
                yield from ((where, c, False) for c in commands_in(strip_comment(text)))
            else:
                for span in re.findall(r"`([^`]+)`", line):
                    yield from ((where, c, True) for c in commands_in(span))


def strip_comment(text: str) -> str:
    """A shell line without its trailing # comment (a # inside quotes is kept)."""
    quote: str | None = None
    out: list[str] = []
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            break
        out.append(ch)
    return "".join(out).rstrip()


def commands_in(text: str) -> Iterator[str]:
    """The lumenctl/lumend commands in a shell line, one per pipeline segment."""
    for segment in SHELL_OPERATORS.split(f" {text} "):
        match = COMMAND.search(segment)
        if match is None:
            continue
        # Only where the program runs: after nothing, $, sudo [-u USER], environment
        # assignments, or its directory (/opt/lumen/venv/bin/lumend).
        before = segment[:match.start()].split()
        if not all(re.fullmatch(r"\$|sudo|-E|[A-Za-z_][A-Za-z0-9_]*=\S*|\S*/", w)
                   or (i and before[i - 1] == "-u") or w == "-u"
                   for i, w in enumerate(before)):
            continue
        yield segment[match.start():].strip().rstrip(")")


def variants(words: list[str], value: str = "1") -> list[list[str]]:
    """The concrete argument lists a synopsis stands for: optional parts left out, and
    all put in; each `a|b` alternative in turn; placeholders filled with `value`."""

    def expand(with_optional: bool, pick: int, value: str) -> list[str]:
        out: list[str] = []
        depth = 0
        for word in words:
            opening = len(word) - len(word.lstrip("["))
            closing = len(word) - len(word.rstrip("]"))
            core = word.strip("[]")
            depth += opening
            if core and (depth == 0 or with_optional):
                out.append(fill(core, pick, value))
            depth -= closing
        return out

    alternatives = max([len(w.strip("[]").split("|")) for w in words if is_alternation(w)],
                       default=1)
    found = []
    for pick in range(alternatives):
        for with_optional in (False, True):
            candidate = expand(with_optional, pick, value)
            if candidate not in found:
                found.append(candidate)
    return found


def is_alternation(word: str) -> bool:
    return "|" in word.strip("[]")


# What a placeholder is replaced with: each in turn, until one parses (a placeholder
# stands for any valid value, and options have ranges: --nodes 3..9, --trace >= 4).
FILLS = ("1", "4", "x")


def fill(word: str, pick: int, value: str = "1") -> str:
    if is_alternation(word):
        choices = word.split("|")
        word = choices[min(pick, len(choices) - 1)]
    if "=" in word and word.startswith("--"):
        name, _, given = word.partition("=")
        return f"{name}={fill(given, pick, value)}" if given else word
    return value if PLACEHOLDER.match(word) else word


@functools.cache
def parser(program: str) -> Any:
    """The program's real command tree (typer builds it anew on each call) with every
    command's body replaced by nothing: parsing and its checks stay, nothing runs."""
    command = typer.main.get_command(PROGRAMS[program])

    def silence(c: Any) -> None:
        c.callback = lambda *a, **kw: None
        for sub in getattr(c, "commands", {}).values():
            silence(sub)

    silence(command)
    return command


def check(program: str, args: list[str]) -> str | None:
    """None when `args` parse as `program` parses its argv; otherwise its message."""
    if program == "lumenctl":
        args = _normalize_argv(args)  # what lumenctl's main() does first
    try:
        code = parser(program).main(list(args), prog_name=program, standalone_mode=False)
    except Exception as exc:  # click's (typer's own copy) UsageError and friends
        message = getattr(exc, "format_message", None)
        if message is None:
            raise
        return str(message())
    return None if code in (None, 0) else f"exit {code}"


COMMANDS = sorted(set(shown_commands()))
# An inline mention of a command or option (`lumenctl failover`, `lumenctl --timeout`) need
# not be a whole command line: only these may be missing. Everything else must be right.
MENTION = ("Missing argument", "requires an argument", "Missing command")


def test_the_docs_show_commands() -> None:
    programs = {text.split()[0] for _, text, _ in COMMANDS}
    assert programs == {"lumenctl", "lumend"}
    assert len([c for c in COMMANDS if not c[2]]) > 40, len(COMMANDS)


def problems(text: str, inline: bool = False) -> list[str]:
    """How each concrete form of a shown command fails to parse (none: it parses)."""
    words = shlex.split(text)
    program, args = words[0], words[1:]
    if inline and not args:
        return []  # the program's name in prose
    found = []
    for number in range(len(variants(args))):
        tried = [(v, check(program, v)) for v in
                 (variants(args, value)[number] for value in FILLS)]
        if all(problem is not None for _, problem in tried):
            v, problem = tried[0]
            assert problem is not None
            if not (inline and any(m in problem for m in MENTION)):
                found.append(f"{' '.join([program, *v])}: {problem}")
    return found


@pytest.mark.parametrize(("where", "text", "inline"), COMMANDS,
                         ids=[f"{w} {t}" for w, t, _ in COMMANDS])
def test_a_command_the_docs_show_parses(where: str, text: str, inline: bool) -> None:
    try:
        shlex.split(text)
    except ValueError as exc:
        pytest.fail(f"{where}: {text!r} is not a shell line: {exc}")
    found = problems(text, inline)
    assert not found, f"{where}: `{text}` does not parse:\n" + "\n".join(found)


@pytest.mark.parametrize(("text", "says"), [
    ("lumenctl status --wach", "No such option: --wach"),
    ("lumenctl drain", "Missing argument"),
    ("lumenctl config sett theta 32", "No such command 'sett'"),
    ("lumend run --conf /etc/lumen/lumend.toml", "No such option: --conf"),
    ("lumenctl status -o xml", "'xml' is not one of"),
])
def test_the_check_catches_a_wrong_command(text: str, says: str) -> None:
    """Negative controls: each of these is refused, naming what is wrong."""
    found = problems(text)
    assert found and all(says in p for p in found), found
    # Inline, a mention may leave out arguments, but not be wrong.
    assert problems("lumenctl drain", inline=True) == []
    assert problems("lumenctl drian", inline=True) != []


def test_synopsis_notation() -> None:
    assert variants(shlex.split("drain NODE|WORKER [--migrate] [--wait [--timeout S]]")) == [
        ["drain", "1"], ["drain", "1", "--migrate", "--wait", "--timeout", "1"]]
    assert variants(["status", "-o", "table|json|yaml"]) == [
        ["status", "-o", "table"], ["status", "-o", "json"], ["status", "-o", "yaml"]]
    assert list(commands_in("sudo -u lumen /opt/lumen/venv/bin/lumend check-config X")) == [
        "lumend check-config X"]
    assert list(commands_in("lumenctl status -o json | jq .nodes")) == [
        "lumenctl status -o json"]
    assert list(commands_in("the lumend process")) == []
