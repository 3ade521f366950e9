"""The command lines README.md and docs/operator-guide.md show in their shell blocks, run
for real where that is safe here: every concrete lumenctl line (no placeholders) against a
real etcd holding the nodes the docs name, in the order the docs give them, and lumend's
check-config and version on the example config. tests/unit/test_doc_commands.py parses
every line; this one runs them, so a line that parses but fails (a value the command
refuses, a target the docs never registered) is caught.

Not run here, each for a reason: lines that follow forever (`--watch`), need a live lumend
(`agent`, `failover`, a drain of a worker, which waits for its node to report it), name a
placeholder (the synopsis lines), or need certificates or hosts that exist only in a
deployment (`--endpoints https://...`, `lumend run`, `lumend gms-server`, `demo`, `sim`
are covered by their own tests). A line that would ask (drain, config set) gets `--yes`, as
an operator answering the prompt."""

from __future__ import annotations

import asyncio
import re
import shlex
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lumenctl.localcluster import EtcdCluster
from lumenctl.main import _normalize_argv
from lumenctl.main import app as lumenctl_app
from lumend.checkpoint.security import CurveKeys
from lumend.cli import app as lumend_app
from lumend.cluster.keys import Keys
from lumend.cluster.models import NodeRecord, encode_value
from lumend.cluster.store import EtcdStore
from tests.unit.test_doc_commands import PLACEHOLDER, commands_in, strip_comment

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "docs" / "operator-guide.md"]
CLUSTER = "docs"
EXAMPLE = REPO / "examples" / "lumend.toml"
RUNNABLE = {"status", "events", "checkpoints", "config", "drain", "undrain", "version"}
WORKER = re.compile(r"-w\d+$")
ASKS = {"drain", "set"}


def block_lines() -> list[tuple[str, str]]:
    """(where, command) for each lumenctl/lumend command in the docs' code blocks."""
    found = []
    for doc in DOCS:
        in_block, continued = False, ""
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_block = not in_block
                continue
            if not in_block:
                continue
            text = continued + line
            if text.endswith("\\"):
                continued = text[:-1] + " "
                continue
            continued = ""
            found += [(f"{doc.relative_to(REPO)}:{number}", c)
                       for c in commands_in(strip_comment(text))]
    return found


def runnable(words: list[str]) -> bool:
    program, args = words[0], words[1:]
    if any("[" in w or "|" in w or PLACEHOLDER.match(w) for w in args):
        return False  # a synopsis: parsed by test_doc_commands
    if program == "lumend":
        return args[:1] in (["version"], ["check-config"])
    verbs = [w for w in args if not w.startswith("-")]
    if not verbs or verbs[0] not in RUNNABLE:
        return False
    if any(w in ("--watch", "-w", "--endpoints", "--ca-cert") for w in args):
        return False
    return not (verbs[0] == "drain" and WORKER.search(verbs[1]))


def named_nodes(lines: list[list[str]]) -> set[str]:
    """The node names the runnable lines drain and undrain."""
    return {words[words.index(verb) + 1] for words in lines
            for verb in ("drain", "undrain") if verb in words}


def register(etcd: EtcdCluster, nodes: set[str]) -> None:
    """Node records as a lumend that just joined writes them (no workers)."""
    async def put() -> None:
        store = EtcdStore(etcd.endpoints)
        try:
            for name in sorted(nodes):
                now = time.time()
                record = NodeRecord(name=name, address="127.0.0.1", pid=1, version="0.1.0",
                                    started_at=now, updated_at=now, gateway="127.0.0.1:1",
                                    rpc="127.0.0.1:2", checkpoint="127.0.0.1:3",
                                    metrics="127.0.0.1:4")
                await store.put(Keys(CLUSTER).node(name), encode_value(record))
        finally:
            await store.close()

    asyncio.run(put())


def example_config(tmp_path: Path) -> Path:
    """examples/lumend.toml with its key file path pointing at a real key file."""
    keys = tmp_path / "checkpoint.keys"
    CurveKeys.generate().write(keys)
    config = tmp_path / "lumend.toml"
    config.write_text(EXAMPLE.read_text().replace("/etc/lumen/checkpoint.keys", str(keys)))
    return config


def run(words: list[str], etcd: EtcdCluster, config: Path) -> tuple[int, str]:
    program, args = words[0], words[1:]
    if program == "lumend":
        args = [str(config) if a == "/etc/lumen/lumend.toml" else a for a in args]
        result = CliRunner().invoke(lumend_app, args)
        return result.exit_code, result.output
    if any(a in ASKS for a in args) and "--yes" not in args and "-y" not in args:
        args = [*args, "--yes"]
    base = ["--config", "/nonexistent/lumend.toml", "--endpoints", ",".join(etcd.endpoints),
            "--cluster", CLUSTER]
    result = CliRunner().invoke(lumenctl_app, _normalize_argv([*base, *args]))
    return result.exit_code, result.output


LINES = block_lines()
RUN = [(where, text) for where, text in LINES if runnable(shlex.split(text))]


def test_the_docs_have_lines_to_run() -> None:
    verbs = {shlex.split(text)[1] for _, text in RUN}
    assert {"status", "config", "drain", "undrain", "version", "check-config"} <= verbs, RUN
    assert len(RUN) >= 15, RUN


@pytest.mark.etcd
def test_every_runnable_line_runs(etcd: EtcdCluster, tmp_path: Path) -> None:
    register(etcd, named_nodes([shlex.split(text) for _, text in RUN]))
    config = example_config(tmp_path)
    failed = []
    for where, text in RUN:
        code, output = run(shlex.split(text), etcd, config)
        if code != 0:
            failed.append(f"{where}: `{text}` exited {code}: {output.strip()[-400:]}")
    assert not failed, "\n".join(failed)
    # Negative controls: lines that parse but fail when run are reported as failing.
    for text in ("lumenctl config set theta lots", "lumenctl drain gpu-node-9 --yes",
                 "lumend check-config /nonexistent.toml"):
        assert run(shlex.split(text), etcd, config)[0] != 0, text
