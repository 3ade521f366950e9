"""lumend and systemd: sd_notify messages, the watchdog, and logging to the journal.

`SystemdLink` tells systemd what the node is doing (`Type=notify`):

* `READY=1` once the node is registered in etcd and the worker-readiness hook says its
  workers serve (or stand by); until then `EXTEND_TIMEOUT_USEC=` keeps the start job alive,
  but only while the HA loop completes cycles, so a node hung at start still times out.
* `STATUS=` the node's one-sentence status whenever it changes.
* `WATCHDOG=1` every half `WATCHDOG_USEC`, and only while the HA loop has completed a cycle
  within the last `WATCHDOG_USEC`: a loop stuck in an await stops the pings even though
  the event loop (and this task) still run, and systemd restarts the node.
* `RELOADING=1` / `READY=1` around a config reload, `STOPPING=1` at the start of a stop.

Messages go through systemd-python's `systemd.daemon.notify` when it is installed, else
straight to the `NOTIFY_SOCKET` datagram socket (sd_notify(3) protocol, abstract sockets
included). Without `NOTIFY_SOCKET` (not started by systemd) nothing is sent.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any, Protocol

log = logging.getLogger(__name__)

JOURNAL_SOCKET = "/run/systemd/journal/socket"


# -- the transport --------------------------------------------------------------------------


def send_datagram(address: str, message: str) -> None:
    """One sd_notify datagram to `address` (a path, or "@name" for an abstract socket)."""
    target = "\0" + address[1:] if address.startswith("@") else address
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.sendto(message.encode(), target)


def _systemd_module(name: str) -> Any:
    """systemd-python's `systemd.<name>`, or None. Imported by name: the repository's own
    systemd/ folder (unit files) would otherwise shadow the package for mypy."""
    try:
        return importlib.import_module(f"systemd.{name}")
    except ImportError:
        return None


def _systemd_python_notify() -> Callable[[str], bool] | None:
    daemon = _systemd_module("daemon")
    if daemon is None:
        return None

    def send(message: str) -> bool:
        return bool(daemon.notify(message))

    return send


class Notifier:
    """Sends sd_notify messages to the socket systemd gave this process, if any."""

    def __init__(self, address: str | None, *, use_systemd_python: bool = True) -> None:
        self.address = address
        library = _systemd_python_notify() if use_systemd_python and address else None
        self.via = "systemd-python" if library else "datagram" if address else "none"
        self._library = library
        self._warned = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        return cls(environ.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str | int) -> bool:
        """Send `KEY=value` lines in one datagram, e.g. send(READY=1, STATUS="...")."""
        if self.address is None:
            return False
        message = "\n".join(f"{key}={_one_line(value)}" for key, value in fields.items())
        try:
            if self._library is not None:
                sent = self._library(message)
            else:
                send_datagram(self.address, message)
                sent = True
        except OSError as exc:
            sent = False
            reason = str(exc)
        else:
            reason = "sd_notify returned 0"
        if not sent and not self._warned:
            self._warned = True  # once: a vanished socket must not flood the log
            log.warning("could not notify systemd at NOTIFY_SOCKET=%s (%s)", self.address, reason)
        return sent


def _one_line(value: str | int) -> str:
    return " ".join(str(value).splitlines())


def watchdog_interval_s(environ: Mapping[str, str] = os.environ, pid: int | None = None) -> (
    float | None
):
    """The watchdog interval systemd asks for (`WATCHDOG_USEC`), or None when there is none.

    `WATCHDOG_PID`, when set, names the process the interval is meant for (not a child)."""
    usec = environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    owner = environ.get("WATCHDOG_PID")
    if owner and owner != str(pid if pid is not None else os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not a whole number of microseconds", usec)
        return None
    return value / 1e6 if value > 0 else None


# -- what lumend tells systemd ---------------------------------------------------------------


@dataclass(frozen=True)
class Readiness:
    ready: bool
    detail: str  # why not, or what "ready" means now; shown in STATUS and logs


class LoopState(Protocol):
    """What SystemdLink reads from the HA loop (lumend.cluster.agent.ClusterAgent)."""

    @property
    def registered(self) -> bool: ...

    @property
    def last_cycle_at(self) -> float | None: ...


class SystemdLink:
    """READY/STATUS/EXTEND_TIMEOUT/WATCHDOG from the HA loop's state; see the module doc."""

    def __init__(
        self,
        notifier: Notifier,
        loop_state: LoopState,
        workers_ready: Callable[[], Readiness],
        status: Callable[[], str],
        *,
        watchdog_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.notifier = notifier
        self._loop = loop_state
        self._workers_ready = workers_ready
        self._status = status
        self.watchdog_s = watchdog_s
        self._clock = clock
        # Without a watchdog the same rule still gates EXTEND_TIMEOUT_USEC.
        self.stale_after_s = watchdog_s if watchdog_s is not None else 30.0
        self.tick_s = min(1.0, watchdog_s / 4) if watchdog_s is not None else 1.0
        self.ready_sent = False
        self.stopping = False
        self.watchdog_pings = 0
        self._last_status = ""
        self._last_ping = float("-inf")
        self._wake = asyncio.Event()

    def readiness(self) -> Readiness:
        if not self._loop.registered:
            return Readiness(False, "not registered in etcd yet")
        return self._workers_ready()

    def loop_healthy(self) -> bool:
        """The HA loop finished a cycle within the last `stale_after_s` seconds."""
        last = self._loop.last_cycle_at
        return last is not None and self._clock() - last <= self.stale_after_s

    def poke(self, *_: object) -> None:
        """Re-evaluate now (the HA loop calls this after each cycle)."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._wake.clear()
            self.tick()
            waiters = [asyncio.ensure_future(e.wait()) for e in (stop, self._wake)]
            try:
                await asyncio.wait(waiters, timeout=self.tick_s,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()

    def tick(self) -> None:
        if self.stopping:
            return
        healthy = self.loop_healthy()
        status = self._status()
        if not self.ready_sent:
            readiness = self.readiness()
            if readiness.ready:
                self.ready_sent = True
                self._last_status = status
                self.notifier.send(READY=1, STATUS=status)
                log.info("ready: %s", readiness.detail)
            elif healthy:
                # Must be renewed before it runs out; three ticks leave room for a slow one.
                extend_usec = int(max(10.0, 3 * self.tick_s) * 1e6)
                self.notifier.send(EXTEND_TIMEOUT_USEC=extend_usec)
        if status != self._last_status:
            self._last_status = status
            self.notifier.send(STATUS=status)
        if (
            self.watchdog_s is not None
            and healthy
            and self._clock() - self._last_ping >= self.watchdog_s / 2
        ):
            self._last_ping = self._clock()
            self.watchdog_pings += 1
            self.notifier.send(WATCHDOG=1)

    def reloading(self) -> None:
        monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.notifier.send(RELOADING=1, MONOTONIC_USEC=monotonic_usec,
                            STATUS="reloading the configuration")

    def reloaded(self, outcome: str) -> None:
        self._last_status = f"{outcome}; {self._status()}"
        if self.ready_sent:
            self.notifier.send(READY=1, STATUS=self._last_status)
        else:  # reloaded before the first READY: that READY comes when the node is ready
            self.notifier.send(STATUS=self._last_status)

    def stop(self, why: str) -> None:
        self.stopping = True
        self.notifier.send(STOPPING=1, STATUS=f"stopping ({why}): resigning and deregistering")


# -- logging ---------------------------------------------------------------------------------


def stderr_is_journal(environ: Mapping[str, str], stream: IO[str]) -> bool:
    """Whether `stream` is the journal stream systemd connected (`JOURNAL_STREAM=dev:ino`)."""
    value = environ.get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(stream.fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (OSError, ValueError):
        return False


_PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
               logging.CRITICAL: 2}


class PriorityPrefixFormatter(logging.Formatter):
    """`<N>` syslog priority prefixes (sd-daemon(3)); journald parses them off stderr."""

    def format(self, record: logging.LogRecord) -> str:
        priority = _PRIORITIES.get(record.levelno, 6)
        return f"<{priority}>{super().format(record)}"


def log_handler(
    node: str, environ: Mapping[str, str] = os.environ, stream: IO[str] = sys.stderr
) -> logging.Handler:
    """The handler lumend logs through: the journal (with fields) when run by systemd with
    its stderr on the journal, else stderr with timestamps."""
    if stderr_is_journal(environ, stream):
        journal = _systemd_module("journal") if os.path.exists(JOURNAL_SOCKET) else None
        if journal is not None:
            handler: logging.Handler = journal.JournalHandler(
                SYSLOG_IDENTIFIER="lumend", LUMEN_NODE=node
            )
            handler.setFormatter(logging.Formatter("%(message)s"))
            return handler
        # The journal timestamps each line itself.
        handler = logging.StreamHandler(stream)
        handler.setFormatter(PriorityPrefixFormatter("%(name)s: %(message)s"))
        return handler
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    return handler
