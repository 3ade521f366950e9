"""API keys of the gateway: the key file and the check of `Authorization: Bearer <key>`.

The file (`[gateway] api_keys`) holds one key per line, either bare or as `name: key`;
blank lines and lines starting with `#` are ignored. It holds secrets, so it must be a
regular file that neither group nor others can access (mode 0600 or stricter). No file
configured: no keys, the gateway is open.

Pure (no aiohttp): the config check and the daemon use it too.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field

log = logging.getLogger("lumend.gateway")

MIN_KEY_CHARS = 16
MAX_FILE_BYTES = 1 << 20
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,62}")
_KEY_RE = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces (an HTTP header token)
KEY_HINT = "make one with `openssl rand -hex 32`"


class ApiKeyFileError(Exception):
    """The key file cannot be used; the message names the file, the problem and the fix."""


@dataclass(frozen=True)
class Denied:
    """Why a request was refused: the OpenAI error type and a message for the client."""

    kind: str  # "invalid_request_error" (no usable header) or "authentication_error"
    message: str


@dataclass(frozen=True)
class ApiKeys:
    """The keys by name; only their SHA-256 digests are kept, compared in constant time."""

    path: str
    digests: tuple[tuple[str, bytes], ...]  # (name, sha256(key))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.digests]

    def __len__(self) -> int:
        return len(self.digests)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ApiKeys:
        where = os.fspath(path)
        try:
            fd = os.open(where, os.O_RDONLY)
        except FileNotFoundError:
            raise ApiKeyFileError(
                f"API key file {where} does not exist; create it (one key per line, or "
                f"`name: key`; {KEY_HINT}) with mode 0600, or remove [gateway] api_keys to "
                "run the gateway without keys") from None
        except OSError as exc:
            raise ApiKeyFileError(
                f"API key file {where} cannot be read ({exc.strerror}); make it readable by "
                "the user lumend runs as (and by no one else: chmod 600)") from None
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise ApiKeyFileError(f"API key file {where} is not a regular file")
            if mode & 0o077:
                raise ApiKeyFileError(
                    f"API key file {where} is accessible by group or others (mode "
                    f"{stat.S_IMODE(mode):04o}); it holds secrets: `chmod 600 {where}`")
            raw = os.read(fd, MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
        if len(raw) > MAX_FILE_BYTES:
            raise ApiKeyFileError(f"API key file {where} is larger than {MAX_FILE_BYTES} "
                                  "bytes; it should hold one key per line")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiKeyFileError(f"API key file {where} is not UTF-8 text ({exc.reason})"
                                  ) from None
        return cls.parse(text, where)

    @classmethod
    def parse(cls, text: str, where: str = "<string>") -> ApiKeys:
        digests: list[tuple[str, bytes]] = []
        names: dict[str, int] = {}
        keys: dict[bytes, int] = {}
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            at = f"API key file {where} line {number}"
            name, sep, key = line.partition(":")
            if sep:
                name, key = name.strip(), key.strip()
                if not _NAME_RE.fullmatch(name):
                    raise ApiKeyFileError(
                        f"{at}: the name before ':' must be 1-63 letters, digits, '.', '_', "
                        "'@' or '-'; write `name: key` or the key alone")
            else:
                name, key = f"line-{number}", line
            # The messages never show the key itself: it is a secret, and logs are not.
            if not _KEY_RE.fullmatch(key):
                raise ApiKeyFileError(f"{at}: the key must be printable ASCII without spaces; "
                                      f"{KEY_HINT}")
            if len(key) < MIN_KEY_CHARS:
                raise ApiKeyFileError(f"{at}: the key is shorter than {MIN_KEY_CHARS} "
                                      f"characters; {KEY_HINT}")
            if name in names:
                raise ApiKeyFileError(f"{at}: the name {name!r} is used on line "
                                      f"{names[name]} too; give each key its own name")
            digest = hashlib.sha256(key.encode()).digest()
            if digest in keys:
                raise ApiKeyFileError(f"{at}: the same key is on line {keys[digest]}; "
                                      "give each client its own key")
            names[name], keys[digest] = number, number
            digests.append((name, digest))
        if not digests:
            raise ApiKeyFileError(
                f"API key file {where} holds no key; add one per line ({KEY_HINT}), or "
                "remove [gateway] api_keys to run the gateway without keys")
        return cls(where, tuple(digests))

    def check(self, authorization: str | None) -> str | Denied:
        """The name of the key the header carries, or why the request is refused."""
        if authorization is None:
            return Denied("invalid_request_error", "no API key: send the header "
                          "'Authorization: Bearer <key>'")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return Denied("invalid_request_error", "the Authorization header must be "
                          "'Bearer <key>'")
        given = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        # Compare with every key, always: the time taken does not tell which one was close.
        found: str | None = None
        for name, digest in self.digests:
            if hmac.compare_digest(given, digest) and found is None:
                found = name
        if found is None:
            return Denied("authentication_error", "incorrect API key")
        return found


def load_api_keys(path: str | None) -> ApiKeys | None:
    """The configured keys; None when no file is configured (the gateway is open)."""
    return None if path is None else ApiKeys.load(path)


@dataclass
class RefusalLog:
    """Logs refused requests without letting a client flood the log: the first at once,
    then at most one line per `every_s` with the count since."""

    every_s: float = 60.0
    _last: float = field(default=-float("inf"))
    _since: int = 0

    def refused(self, remote: str | None, why: str) -> None:
        self._since += 1
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        log.warning("gateway: refused %d requests without a valid API key (the last from %s: "
                    "%s)", self._since, remote or "an unknown address", why)
        self._last, self._since = now, 0
