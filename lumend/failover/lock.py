"""The failover lock: a `flock` on a node-local file elects a worker's active engine.

The kernel drops an flock when the process holding it dies, however it dies, so a shadow
waiting on the lock learns of the active engine's death without any heartbeat. The lock
file is never deleted while engines run: an engine that re-created it would lock a new
inode while another still holds the old one, and both would be active.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import time
from pathlib import Path


class LockFileError(Exception):
    """The lock file cannot be created or opened."""


class FailoverLock:
    def __init__(self, path: str | os.PathLike[str], owner: str) -> None:
        self.path = Path(path)
        self.owner = owner
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _open(self) -> int:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as exc:
            raise LockFileError(
                f"cannot create the failover lock {self.path}: {exc.strerror}; make its "
                f"directory writable by the lumend user (systemd: RuntimeDirectory=lumen)"
            ) from exc

    def try_acquire(self) -> bool:
        """Take the lock if it is free; never blocks."""
        if self._fd is not None:
            return True
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        # Holding the lock now: record who we are, for operators and `owner()`.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.owner}\n".encode(), 0)
        self._fd = fd
        return True

    async def acquire(self, poll_s: float = 0.02) -> None:
        """Wait until the lock is ours (polled: flock has no async wake-up)."""
        while not self.try_acquire():  # flock has nothing to await
            await asyncio.sleep(poll_s)

    async def hand_over(self, timeout_s: float = 5.0) -> None:
        """Release, then wait (bounded) until another holder has recorded itself, so the
        caller does not win the lock straight back before a waiting shadow polls it."""
        self.release()
        deadline = time.monotonic() + timeout_s
        while self.read_owner() == self.owner and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock; the file stays

    def read_owner(self) -> str | None:
        """The owner id written by the current (or last) holder, if any."""
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return None
        return text or None
