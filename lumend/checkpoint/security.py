"""CURVE keys of a cluster's checkpoint sockets (KV pages are user data).

One key file per cluster, the same on every node: every holder is a CURVE server with the
server key pair, and every engine presents the client key pair. A peer without the file
can neither complete the handshake (it lacks the server's public key) nor pass the holder's
ZAP check (it lacks the client key pair), so it is refused; traffic is encrypted.

The file is TOML, four Z85 strings (40 characters each, as `zmq.curve_keypair()` makes
them), and must be private to its owner (mode 0600):

    server_public = "..."
    server_secret = "..."
    client_public = "..."
    client_secret = "..."

Engines find it through the environment variable LUMEN_CKPT_KEYS (lumend sets it).
"""

from __future__ import annotations

import os
import stat
import struct
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

ENV_VAR = "LUMEN_CKPT_KEYS"
FIELDS = ("server_public", "server_secret", "client_public", "client_secret")
_KEY_CHARS = 40  # Z85 of 32 bytes


class KeyFileError(Exception):
    """The key file cannot be used; the message names the path, the problem and the fix."""


@dataclass(frozen=True)
class CurveKeys:
    """The cluster's key pairs, as Z85 text."""

    server_public: str
    server_secret: str
    client_public: str
    client_secret: str

    @classmethod
    def generate(cls) -> CurveKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public.decode(), server_secret.decode(), client_public.decode(),
                   client_secret.decode())

    @property
    def client_public_raw(self) -> bytes:
        """The client's public key as ZAP presents it (32 bytes)."""
        return bytes(z85.decode(self.client_public))

    def write(self, path: str | os.PathLike[str], *, force: bool = False) -> None:
        """Write the file with mode 0600 (created so, never readable by others in between);
        FileExistsError unless `force`."""
        text = ("# LUMEN checkpoint CURVE keys: the same file on every node of the cluster.\n"
                "# Keep it secret (mode 0600, owned by the lumend user).\n"
                + "".join(f'{name} = "{getattr(self, name)}"\n' for name in FIELDS))
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
        fd = os.open(path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)  # an existing file overwritten with --force keeps no looser mode
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CurveKeys:
        """Read and check the file: private, TOML, four valid Z85 keys, public keys that
        belong to their secret keys. KeyFileError names the problem and the fix."""
        where = os.fspath(path)
        try:
            fd = os.open(where, os.O_RDONLY)
        except FileNotFoundError:
            raise KeyFileError(f"checkpoint key file {where} does not exist; create it with "
                               f"`lumenctl keys generate {where}` and copy it to every node"
                               ) from None
        except OSError as exc:
            raise KeyFileError(f"checkpoint key file {where} cannot be read ({exc.strerror}); "
                               "make it readable by the user lumend runs as") from None
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise KeyFileError(f"checkpoint key file {where} is not a regular file")
            if mode & 0o077:
                raise KeyFileError(
                    f"checkpoint key file {where} is accessible by group or others (mode "
                    f"{stat.S_IMODE(mode):04o}); it holds secret keys: `chmod 600 {where}`")
            raw = os.read(fd, 64 * 1024)
        finally:
            os.close(fd)
        try:
            document = tomllib.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise KeyFileError(f"checkpoint key file {where} is not TOML ({exc}); regenerate "
                               f"it with `lumenctl keys generate --force {where}`") from None
        return cls.from_mapping(document, where)

    @classmethod
    def from_mapping(cls, document: Mapping[str, Any], where: str) -> CurveKeys:
        unknown = sorted(set(document) - set(FIELDS))
        if unknown:
            raise KeyFileError(f"checkpoint key file {where}: unknown key {unknown[0]!r}; "
                               f"the keys are {', '.join(FIELDS)}")
        values: dict[str, str] = {}
        for name in FIELDS:
            value = document.get(name)
            if value is None:
                raise KeyFileError(f"checkpoint key file {where}: {name} is missing; "
                                   f"regenerate it with `lumenctl keys generate --force {where}`")
            if not isinstance(value, str) or not _is_z85_key(value):
                raise KeyFileError(f"checkpoint key file {where}: {name} is not a CURVE key "
                                   f"({_KEY_CHARS} Z85 characters); regenerate it with "
                                   f"`lumenctl keys generate --force {where}`")
            values[name] = value
        for side in ("server", "client"):
            public = zmq.curve_public(values[f"{side}_secret"].encode()).decode()
            if public != values[f"{side}_public"]:
                raise KeyFileError(f"checkpoint key file {where}: {side}_public does not "
                                   f"belong to {side}_secret; regenerate the file with "
                                   f"`lumenctl keys generate --force {where}`")
        return cls(**values)

    # -- sockets ----------------------------------------------------------------------------

    def serve(self, sock: zmq.Socket[Any]) -> None:
        """Make `sock` a CURVE server (before bind)."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public.encode())

    def connect_as_client(self, sock: zmq.Socket[Any]) -> None:
        """Make `sock` a CURVE client of the cluster's holders (before connect)."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public.encode())
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret.encode())


def _is_z85_key(text: str) -> bool:
    if len(text) != _KEY_CHARS:
        return False
    try:
        return len(z85.decode(text)) == 32
    except (ValueError, KeyError, TypeError, struct.error):  # what z85 raises on bad text
        return False


def client_keys_from_env(env: Mapping[str, str] | None = None) -> CurveKeys | None:
    """The keys named by LUMEN_CKPT_KEYS, or None when it is unset or empty (insecure).
    A set variable whose file is unusable raises KeyFileError: an engine told to be secure
    must not fall back to sending pages in clear."""
    path = (os.environ if env is None else env).get(ENV_VAR, "")
    if not path:
        return None
    try:
        return CurveKeys.load(path)
    except KeyFileError as exc:
        raise KeyFileError(f"{ENV_VAR}={path}: {exc}") from None
