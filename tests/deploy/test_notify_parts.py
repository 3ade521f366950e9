"""The sd_notify transport, the watchdog environment, journal detection and reload plans,
without lumend processes (real sockets and files)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import msgspec
import pytest

from lumend.config import parse_config
from lumend.notify import (
    Notifier,
    send_datagram,
    stderr_is_journal,
    watchdog_interval_s,
)
from lumend.reload import changed_keys, plan_reload

from .conftest import NotifySocket

EXAMPLE = Path(__file__).parents[2] / "examples" / "lumend.toml"


@pytest.mark.parametrize("use_library", [True, False], ids=["systemd-python", "datagram"])
@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_notifier_reaches_path_and_abstract_sockets(
    tmp_path: Path, use_library: bool, abstract: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    address = f"@lumen-parts-{os.getpid()}" if abstract else str(tmp_path / "n.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", address)  # sd_notify(3) reads it from the environment
    sock = NotifySocket(address)
    try:
        notifier = Notifier(address, use_systemd_python=use_library)
        assert notifier.via == ("systemd-python" if use_library else "datagram")
        assert notifier.send(READY=1, STATUS="line one\nline two")
        assert sock.pump() == [{"READY": "1", "STATUS": "line one line two"}]
    finally:
        sock.close()


def test_notifier_without_socket_sends_nothing_and_a_dead_socket_is_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert not Notifier.from_env({}).enabled
    assert Notifier.from_env({}).send(READY=1) is False
    dead = Notifier(str(tmp_path / "gone.sock"), use_systemd_python=False)
    assert dead.send(WATCHDOG=1) is False
    assert dead.send(WATCHDOG=1) is False
    assert caplog.text.count("could not notify systemd") == 1
    with pytest.raises(FileNotFoundError):
        send_datagram(str(tmp_path / "gone.sock"), "READY=1")


def test_watchdog_interval_from_the_environment() -> None:
    assert watchdog_interval_s({}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "42"}, 42) == 30.0
    # Meant for another process (lumend's parent passed its environment on).
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "42"}, 43) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None


def test_journal_stream_detection(tmp_path: Path) -> None:
    with (tmp_path / "a").open("w") as a, (tmp_path / "b").open("w") as b:
        st = os.fstat(a.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert stderr_is_journal(env, a)
        assert not stderr_is_journal(env, b)  # systemd connected another stream
        assert not stderr_is_journal({}, a)
        assert not stderr_is_journal({"JOURNAL_STREAM": "garbage"}, a)
    left, right = socket.socketpair()
    with left, right:
        assert not stderr_is_journal(env, left.makefile("w"))


def test_reload_plan_applies_live_keys_and_refuses_the_rest() -> None:
    text = EXAMPLE.read_text().replace('keys = "/etc/lumen/checkpoint.keys"', "insecure = true")
    old = parse_config(text)
    new = parse_config(
        text.replace('listen = "0.0.0.0:9440"', 'listen = "0.0.0.0:9441"')
        .replace('endpoints = ["http://10.0.0.1:2379"]',
                 'endpoints = ["http://10.0.0.1:2379", "http://10.0.0.2:2379"]')
        .replace("gpus = [0, 1, 2, 3]", "gpus = [0, 1]")
    )
    assert changed_keys(old, new) == ["etcd.endpoints", "metrics.listen", "workers[0].gpus"]
    plan = plan_reload(old, new)
    assert plan.live == ["metrics.listen"]
    assert plan.refused == ["etcd.endpoints", "workers[0].gpus"]
    assert plan.config.metrics.listen == "0.0.0.0:9441"
    assert plan.config.etcd == old.etcd and plan.config.workers == old.workers
    assert plan_reload(old, old).live == plan_reload(old, old).refused == []

    logging_on = msgspec.structs.replace(new, gateway=msgspec.structs.replace(
        new.gateway, log_admissions=True))
    plan = plan_reload(old, logging_on)
    assert plan.live == ["gateway.log_admissions", "metrics.listen"]
    assert plan.config.gateway.log_admissions
    assert plan.config.gateway.api_keys == old.gateway.api_keys

    no_workers = msgspec.structs.replace(old, workers=[])
    assert changed_keys(old, no_workers) == ["workers"]


def test_log_handler_under_journald_and_not(tmp_path: Path) -> None:
    import logging

    from lumend.notify import JOURNAL_SOCKET, log_handler

    record = logging.LogRecord("lumend", logging.WARNING, __file__, 1, "lease lost", None, None)
    with (tmp_path / "stderr").open("w") as stream:
        st = os.fstat(stream.fileno())
        journal_env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        handler = log_handler("n1", journal_env, stream)
        if os.path.exists(JOURNAL_SOCKET):  # a real journal: structured fields
            assert type(handler).__name__ == "JournalHandler"
        else:  # stderr into the journal: syslog priority prefixes, no timestamps
            assert handler.format(record) == "<4>lumend: lease lost"
        plain = log_handler("n1", {}, stream).format(record)
        assert plain.endswith("WARNING lumend: lease lost") and plain[:4].isdigit()
