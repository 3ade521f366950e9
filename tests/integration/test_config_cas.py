"""`lumenctl config set` is a compare-and-swap against the settings it showed: a change
made by someone else between the read (the diff shown, the prompt) and the write is
refused, naming what changed, and nothing is written. Against a real etcd."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from typer.testing import CliRunner

import lumend.coordinator.settings as settings_module
from lumenctl.localcluster import EtcdCluster
from lumenctl.main import app
from lumend.cluster.store import EtcdStore

CLUSTER = "cas"


def ctl_args(etcd: EtcdCluster, *args: str) -> list[str]:
    return ["--config", "/nonexistent/lumend.toml", "--endpoints", ",".join(etcd.endpoints),
            "--cluster", CLUSTER, *args]


def other_operator(etcd: EtcdCluster, *args: str) -> None:
    """A second lumenctl, in its own process, as another operator would run it."""
    done = subprocess.run([sys.executable, "-m", "lumenctl", *ctl_args(etcd, *args)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def get(etcd: EtcdCluster, key: str) -> str:
    result = CliRunner().invoke(app, ctl_args(etcd, "config", "get", key))
    assert result.exit_code == 0, result.output
    return result.output.strip()


def someone_writes_meanwhile(etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch, key: str,
                             value: str) -> Callable[..., Any]:
    """Once lumenctl has read the settings (and parses the new value), another operator sets
    `key`; returns the real parse function, to put back."""
    parse = settings_module.parse_setting

    def parse_then_someone_else_writes(*a: Any) -> Any:
        updated = parse(*a)
        other_operator(etcd, "config", "set", key, value, "--yes")
        return updated

    monkeypatch.setattr(settings_module, "parse_setting", parse_then_someone_else_writes)
    return parse


def test_a_change_between_the_diff_and_the_write_is_refused(
        etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    other_operator(etcd, "config", "set", "theta", "40", "--yes")
    # lumenctl has read the settings (theta 40) and is about to show the diff and ask:
    # meanwhile another operator sets theta.
    parse = someone_writes_meanwhile(etcd, monkeypatch, "theta", "32")
    result = CliRunner().invoke(app, ctl_args(etcd, "config", "set", "beta", "3", "--yes"))
    assert result.exit_code == 1, result.output
    assert "+ beta = 3.0" in result.stdout  # the diff was shown against theta 40 ...
    message = " ".join(result.stderr.split())
    assert "changed after they were read" in message
    assert "theta 40.0 -> 32.0" in message  # ... and the error names what changed since
    assert "Nothing was written" in message and "lumenctl config set beta 3" in message
    assert get(etcd, "beta") == "1.0" and get(etcd, "theta") == "32.0"

    # Control: the same command with nobody writing in between applies.
    monkeypatch.setattr(settings_module, "parse_setting", parse)
    applied = CliRunner().invoke(app, ctl_args(etcd, "config", "set", "beta", "3", "--yes"))
    assert applied.exit_code == 0, applied.output
    assert get(etcd, "beta") == "3.0" and get(etcd, "theta") == "32.0"


def test_a_first_write_races_another_first_write(
        etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """No config key yet (all defaults): one created in between is a change too."""
    someone_writes_meanwhile(etcd, monkeypatch, "mode", "fixed_checkpoint")
    result = CliRunner().invoke(app, ctl_args(etcd, "config", "set", "tau", "80", "--yes"))
    assert result.exit_code == 1, result.output
    message = " ".join(result.stderr.split())
    assert "absent then" in message and "mode lumen -> fixed_checkpoint" in message
    assert get(etcd, "tau") == "64" and get(etcd, "mode") == "fixed_checkpoint"


def test_a_put_just_before_the_transaction_is_refused(
        etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last moment: a put landing just before lumenctl's transaction, after every read
    it made, fails the compare on the key's mod revision and is not overwritten (the
    create-revision compare before it let the transaction overwrite it)."""
    other_operator(etcd, "config", "set", "theta", "40", "--yes")
    txn = EtcdStore.txn

    async def put_first(self: EtcdStore, *a: Any, **kw: Any) -> Any:
        await self.put(f"/lumen/{CLUSTER}/config", b'{"theta": 20.0}')
        return await txn(self, *a, **kw)

    monkeypatch.setattr(EtcdStore, "txn", put_first)
    result = CliRunner().invoke(app, ctl_args(etcd, "config", "set", "beta", "3", "--yes"))
    monkeypatch.setattr(EtcdStore, "txn", txn)
    assert result.exit_code == 1, result.output
    assert "theta 40.0 -> 20.0" in " ".join(result.stderr.split())
    assert get(etcd, "theta") == "20.0" and get(etcd, "beta") == "1.0"
