"""Node configuration: the TOML file lumend reads at start, typed, and its validation.

Everything is checked at load and every problem is reported at once, each naming the key,
the bad value and the fix. Code that receives a NodeConfig trusts its types and ranges.
"""

import difflib
import enum
import ipaddress
import json
import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal, TypeGuard, get_args
from urllib.parse import urlsplit

import msgspec

from lumend.checkpoint.security import CurveKeys, KeyFileError
from lumend.engine.sim_models import SIM_DRAFTS, SIM_MODELS
from lumend.engine.vllm_memory import (
    ENGINE_RESERVE_BYTES,
    default_kv_cache_bytes,
    describe_kv_choice,
)
from lumend.gateway.auth import ApiKeyFileError, ApiKeys

DEFAULT_CONFIG_PATH = "/etc/lumen/lumend.toml"

Engine = Literal["vllm", "sim"]
Eviction = Literal["lru", "shortest_prefix", "longest_prefix_protected", "refuse"]
ENGINES: tuple[str, ...] = get_args(Engine)
EVICTIONS: tuple[str, ...] = get_args(Eviction)

MISSING = "<missing>"

_GATEWAY_LISTEN = "0.0.0.0:8000"
_RPC_LISTEN = "0.0.0.0:7440"
_CHECKPOINT_LISTEN = "0.0.0.0:7441"
_METRICS_LISTEN = "0.0.0.0:9440"
_CHECKPOINT_BUDGET = 20 * 1024**3

# --------------------------------------------------------------------------- value parsers

_SIZE_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)")
_SIZE_HINT = (
    'use a size such as "20GiB" or a byte count '
    "(units: B, KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB powers of 1024)"
)


SERVED_MODEL_NAME = "--served-model-name"


def served_model_names(args: list[str]) -> tuple[str, ...]:
    """The names an engine's args give with --served-model-name NAME [NAME ...] or
    --served-model-name=NAME, read as vLLM's parser reads them: the names run up to the
    next option, the last occurrence wins, and --served_model_name is the same option.
    () when not given; ValueError when given without a name."""
    names: tuple[str, ...] = ()
    for i, arg in enumerate(args):
        option, equals, value = arg.partition("=")
        if option.replace("_", "-") != SERVED_MODEL_NAME:
            continue
        if equals:
            names = (value,)
        else:
            following = args[i + 1:]
            end = next((j for j, a in enumerate(following) if a.startswith("-")),
                       len(following))
            names = tuple(following[:end])
        if not names or not all(n.strip() for n in names):
            raise ValueError(f"{arg} needs a name after it, the one clients send, e.g. "
                             f'["{SERVED_MODEL_NAME}", "qwen3-32b"]')
    return names


def parse_size(text: str | int) -> int:
    """A byte count from "20GiB", "1.5GB", "512" or an int; ValueError says what is wrong."""
    if isinstance(text, bool):
        raise ValueError(f"a size cannot be a boolean; {_SIZE_HINT}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative; {_SIZE_HINT}")
        return text
    match = _SIZE_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a size; {_SIZE_HINT}")
    number, unit = match.groups()
    factor = _SIZE_UNITS.get(unit.lower(), 0) if unit else 1
    if not factor:
        raise ValueError(f'unknown unit "{unit}"; {_SIZE_HINT}')
    size = Decimal(number) * factor
    if size != size.to_integral_value():
        raise ValueError(f"not a whole number of bytes; {_SIZE_HINT}")
    return int(size)


_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"(?=.{{1,253}}\Z){_LABEL}(?:\.{_LABEL})*")
_PORT_RE = re.compile(r"[0-9]{1,5}")
_LISTEN_HINT = 'use host:port such as "0.0.0.0:8000" (IPv6 in brackets: "[::1]:8000")'


def parse_listen(text: str) -> tuple[str, int]:
    """(host, port) from "0.0.0.0:8000" or "[::1]:8000"; ValueError says what is wrong."""
    return _split_host_port(text, _LISTEN_HINT)


def _split_host_port(text: str, hint: str) -> tuple[str, int]:
    if "://" in text:
        raise ValueError(f"remove the scheme; {hint}")
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep or not _is_ipv6(host):
            raise ValueError(f"not a bracketed IPv6 address and port; {hint}")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"no port; {hint}")
        if ":" in host:
            raise ValueError(f"an IPv6 address needs brackets; {hint}")
        if not host:
            raise ValueError(f"no host; {hint}")
        if not _HOSTNAME_RE.fullmatch(host):
            raise ValueError(f"not a host name or IP address before the port; {hint}")
    return host, _parse_port(port_text, hint)


def _parse_port(text: str, hint: str) -> int:
    if not text:
        raise ValueError(f"no port; {hint}")
    if not _PORT_RE.fullmatch(text):
        raise ValueError(f'port "{text}" is not a number; {hint}')
    port = int(text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range 1-65535; {hint}")
    return port


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


_ENDPOINT_HINT = 'use "http://host:port" or "https://host:port", e.g. "http://10.0.0.1:2379"'


def _parse_endpoint(url: str) -> tuple[str, int, bool]:
    """(host, port, secure) of an etcd endpoint URL; ValueError says what is wrong."""
    try:
        parts = urlsplit(url)
    except ValueError:  # unbalanced IPv6 brackets
        raise ValueError(f"not a URL; {_ENDPOINT_HINT}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"no http:// or https:// scheme; {_ENDPOINT_HINT}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"only a scheme, host and port are allowed; {_ENDPOINT_HINT}")
    host, port = _split_host_port(parts.netloc, _ENDPOINT_HINT)
    return host, port, parts.scheme == "https"


# --------------------------------------------------------------------------- typed config


class NodeSection(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    address: str  # host name or IP that peers use to reach this node


class EtcdSection(msgspec.Struct, frozen=True, kw_only=True):
    endpoints: list[str]
    cluster: str = "default"
    lease_ttl_s: int = 10
    heartbeat_interval_s: float | None = None  # None: lease_ttl_s / 3
    request_timeout_s: float = 2.0
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None

    @property
    def endpoint_addresses(self) -> list[tuple[str, int, bool]]:
        """(host, port, secure) of each endpoint."""
        return [_parse_endpoint(url) for url in self.endpoints]

    @property
    def effective_heartbeat_s(self) -> float:
        if self.heartbeat_interval_s is None:
            return self.lease_ttl_s / 3
        return self.heartbeat_interval_s


class ListenSection(msgspec.Struct, frozen=True, kw_only=True):
    listen: str

    @property
    def address(self) -> tuple[str, int]:
        return parse_listen(self.listen)


class GatewaySection(msgspec.Struct, frozen=True, kw_only=True):
    listen: str = _GATEWAY_LISTEN
    api_keys: str | None = None  # the API key file (lumend.gateway.auth); None: no keys
    # An upstream is broken when its first token takes longer than first_token_s (queueing
    # and long prefills are not failures) or a later gap exceeds token_timeout_s.
    first_token_s: float = 300.0
    token_timeout_s: float = 30.0
    resume_within_s: float = 120.0  # an interrupted request is given up this long after
    max_streams: int = 1024  # engine streams open at once; more requests get 503
    client_write_s: float = 30.0  # a client that reads nothing for this long is dropped
    # Engine connections are pooled (2 x max_streams); a request that finds the pool full
    # waits this long for one, then fails over like an unreachable engine.
    pool_wait_s: float = 5.0
    # How long a gateway waits for the coordinator's answer to an admission before it
    # admits locally (counted degraded); a recovery waits twice as long. Raise it above the
    # round trip to the coordinator's node plus its decision (under 1 ms) where links are slow.
    admit_deadline_s: float = 0.5
    # How long a stream broken on a worker with shadows waits for one of them to report
    # active, to continue there (checkpoint loaded locally) instead of on another worker.
    # A CUDA shadow's wake (weights mapped, KV cache allocated) may take longer than a CPU
    # twin's milliseconds: raise it to what `failover of ... serves N s after` logs.
    shadow_wait_s: float = 1.0
    # A stopping lumend (SIGTERM) refuses new requests and reports not ready (/ready 503) at
    # once, then lets streams in flight finish for at most drain_s before it stops its
    # engines; 0: stop them at once. Keep it below systemd's TimeoutStopSec (90 s).
    drain_s: float = 30.0
    # One log line per placement decision (request, worker, checkpoint holder, the
    # coordinator's reason), to see where requests went. Off by default: a line per request
    # is a lot on a busy node. Live on reload (SIGHUP).
    log_admissions: bool = False

    @property
    def address(self) -> tuple[str, int]:
        return parse_listen(self.listen)


class RpcSection(msgspec.Struct, frozen=True, kw_only=True):
    listen: str = _RPC_LISTEN
    # mTLS for the gRPC control plane: all three, or none (plaintext).
    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    @property
    def address(self) -> tuple[str, int]:
        return parse_listen(self.listen)

    @property
    def tls_files(self) -> tuple[str, str, str] | None:
        """(ca, cert, key) when mTLS is configured."""
        if self.ca and self.cert and self.key:
            return self.ca, self.cert, self.key
        return None


class CheckpointSection(msgspec.Struct, frozen=True, kw_only=True):
    listen: str = _CHECKPOINT_LISTEN
    budget_bytes: int = _CHECKPOINT_BUDGET  # per worker on this node; 0 holds no checkpoints
    eviction: Eviction = "lru"
    keys: str | None = None  # the cluster's CURVE key file (lumend.checkpoint.security)
    insecure: bool = False  # no CURVE: only where no keys are set (tests)

    @property
    def address(self) -> tuple[str, int]:
        return parse_listen(self.listen)


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    gpus: list[int]
    engine: Engine
    shadows: int = 1
    model: str
    draft_model: str | None = None
    # vLLM: its engines carry LUMEN's draft-assist proposer (a survivor can be assisted),
    # which turns off vLLM's async scheduling on every step; sim engines always can be.
    assist: bool = False
    kv_cache_bytes: int | None = None  # each engine's KV cache (vLLM --kv-cache-memory-bytes)
    args: list[str] = msgspec.field(default_factory=list)
    port: int  # the first engine's port; the shadows take the next ones

    @property
    def engine_ports(self) -> range:
        """The ports of this worker's engines: the active one and its shadows."""
        return range(self.port, self.port + self.shadows + 1)

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names its engines serve under: the --served-model-name of its args, else its
        model (the engine loads `model` either way)."""
        return served_model_names(self.args) or (self.model,)

    @property
    def served_name(self) -> str:
        """The name the cluster knows this worker's model by: what clients send, what the
        gateway routes by, lists in /v1/models and sends on to the engine, and what its
        worker record, checkpoints and drafts are matched by. vLLM serves every name of
        --served-model-name but reports the first; LUMEN routes the first only."""
        return self.served_names[0]

    @property
    def fits_cuda_gms(self) -> bool:
        """Whether a GMS server on CUDA can hold its weights: it serves one GPU, so a
        tensor-parallel worker runs without one (its shadows sleep with vLLM's own weight
        offload instead)."""
        return len(self.gpus) == 1


class NodeConfig(msgspec.Struct, frozen=True, kw_only=True):
    node: NodeSection
    etcd: EtcdSection
    gateway: GatewaySection = msgspec.field(default_factory=GatewaySection)
    rpc: RpcSection = msgspec.field(default_factory=RpcSection)
    checkpoint: CheckpointSection = msgspec.field(default_factory=CheckpointSection)
    metrics: ListenSection = msgspec.field(
        default_factory=lambda: ListenSection(listen=_METRICS_LISTEN)
    )
    workers: list[WorkerConfig] = msgspec.field(default_factory=list)
    state_dir: str = "/var/lib/lumen"
    runtime_dir: str = "/run/lumen"


# --------------------------------------------------------------------------- errors


class ConfigProblem(msgspec.Struct, frozen=True):
    key: str  # dotted path, e.g. "workers[1].gpus"; "<file>" and "<toml>" for the whole file
    value: str  # the bad value as written in TOML, or "<missing>"
    fix: str  # what to do

    def __str__(self) -> str:
        if self.key.startswith("<"):
            return f"{self.value}: {self.fix}"
        if self.value == MISSING:
            return f"{self.key} is missing: {self.fix}"
        return f"{self.key} = {self.value}: {self.fix}"


class ConfigError(Exception):
    """A config that lumend cannot run with; str() lists every problem, one per line."""

    def __init__(self, source: str, problems: list[ConfigProblem]) -> None:
        super().__init__(source, problems)
        self.source = source
        self.problems = list(problems)

    def __str__(self) -> str:
        return "\n".join(f"{self.source}: {problem}" for problem in self.problems)


# --------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike[str]) -> NodeConfig:
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError as exc:
        fix = f"create {source} (start from examples/lumend.toml) or pass another with --config"
        raise _file_error(source, f"cannot read the file ({exc.strerror})", fix) from exc
    except OSError as exc:
        fix = f"make {source} a file lumend can read, or pass another file with --config"
        raise _file_error(source, f"cannot read the file ({exc.strerror})", fix) from exc
    except UnicodeDecodeError as exc:
        raise _file_error(source, f"not UTF-8 text ({exc.reason})", "save it as UTF-8") from exc
    return parse_config(text, source)


def parse_config(text: str, source: str = "<string>") -> NodeConfig:
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        problem = ConfigProblem(key="<toml>", value=str(exc), fix="fix the TOML syntax")
        raise ConfigError(source, [problem]) from exc
    problems: list[ConfigProblem] = []
    data = _validate(document, problems)
    if problems:
        raise ConfigError(source, problems)
    return msgspec.convert(data, NodeConfig)


def _file_error(source: str, value: str, fix: str) -> ConfigError:
    return ConfigError(source, [ConfigProblem(key="<file>", value=value, fix=fix)])


# --------------------------------------------------------------------------- validation

_TOP_KEYS: tuple[str, ...] = ("node", "etcd", "gateway", "rpc", "checkpoint", "metrics")
_TOP_KEYS += ("workers", "state_dir", "runtime_dir")
_NODE_KEYS = ("name", "address")
_ETCD_KEYS: tuple[str, ...] = ("endpoints", "cluster", "lease_ttl_s", "heartbeat_interval_s")
_ETCD_KEYS += ("request_timeout_s", "ca_cert", "cert", "key")
_CHECKPOINT_KEYS = ("listen", "budget_bytes", "eviction", "keys", "insecure")
_CURVE_KEYS_EXAMPLE = "/etc/lumen/checkpoint.keys"
_WORKER_KEYS = ("name", "gpus", "engine", "shadows", "model", "draft_model", "assist",
                "kv_cache_bytes", "args", "port")
_GATEWAY_TIMES = ("first_token_s", "token_timeout_s", "resume_within_s", "client_write_s",
                  "pool_wait_s", "admit_deadline_s", "shadow_wait_s")
_SERVICES = {  # section -> (its keys, default listen address)
    "gateway": (("listen", "api_keys", *_GATEWAY_TIMES, "max_streams", "drain_s",
                 "log_admissions"),
                _GATEWAY_LISTEN),
    "rpc": (("listen", "ca", "cert", "key"), _RPC_LISTEN),
    "checkpoint": (_CHECKPOINT_KEYS, _CHECKPOINT_LISTEN),
    "metrics": (("listen",), _METRICS_LISTEN),
}
_TLS_EXAMPLES = {
    "ca_cert": '"/etc/lumen/etcd-ca.pem"',
    "cert": '"/etc/lumen/etcd-client.pem"',
    "key": '"/etc/lumen/etcd-client-key.pem"',
}
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_NAME_FIX = (
    'use 1-63 letters, digits, ".", "_" or "-", starting with a letter or digit '
    "(it becomes an etcd key segment)"
)
_ROOT_LABEL = "the top level"


class _Absent(enum.Enum):
    ABSENT = enum.auto()


_ABSENT = _Absent.ABSENT


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _show(value: object) -> str:
    """The value as it would be written in TOML, shortened for a one-line message."""
    text = _toml_text(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _toml_text(value: object) -> str:
    if value is _ABSENT:
        return MISSING
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_text(v)}" for k, v in value.items()) + "}"
    return repr(value)


class _Table:
    """One TOML table under validation: reads its keys, records problems under its path.

    Each reader returns the value when it is good, the default when the key is absent and
    None when it is bad (the problem is recorded); good values are kept in `values`.
    """

    def __init__(
        self,
        data: dict[str, Any],
        path: str,
        label: str,
        problems: list[ConfigProblem],
        known: tuple[str, ...],
    ) -> None:
        self.data = data
        self.path = path
        self.label = label
        self.problems = problems
        self.values: dict[str, Any] = {}
        for name, value in data.items():
            if name not in known:
                self.problem(name, value, self._unknown_key_fix(name, known))

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def problem(self, name: str, value: object, fix: str, *, default: bool = False) -> None:
        shown = _show(value) + (" (the default)" if default else "")
        self.problems.append(ConfigProblem(key=self.key(name), value=shown, fix=fix))

    def _unknown_key_fix(self, name: str, known: tuple[str, ...]) -> str:
        if self.label != _ROOT_LABEL and name in ("state_dir", "runtime_dir"):
            # TOML puts every key after a [section] header into that section.
            return f"{name} is a top-level key: move it above the first [section] header"
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            return f'unknown key; did you mean "{close[0]}"?'
        return f"unknown key in {self.label}; the keys there are: {', '.join(known)}"

    def raw(self, name: str, example: str, *, required: bool = False) -> object:
        if name in self.data:
            return self.data[name]
        if required:
            self.problem(name, _ABSENT, f"add {name} = {example} to {self.label}")
        return _ABSENT

    def wrong_type(self, name: str, value: object, expected: str, example: str) -> None:
        self.problem(name, value, f"expected {expected}, e.g. {name} = {example}")

    def text(
        self, name: str, example: str, *, required: bool = False, default: str | None = None
    ) -> str | None:
        value = self.raw(name, example, required=required)
        if value is _ABSENT:
            return default
        if not isinstance(value, str):
            self.wrong_type(name, value, "a string", example)
            return None
        self.values[name] = value
        return value

    def choice(self, name: str, options: tuple[str, ...], *, required: bool = False) -> str | None:
        value = self.text(name, json.dumps(options[0]), required=required)
        if value is not None and value not in options:
            self.problem(name, value, "use one of " + ", ".join(map(json.dumps, options)))
            return None
        return value

    def integer(
        self,
        name: str,
        example: str,
        low: int,
        high: int,
        *,
        required: bool = False,
        default: int | None = None,
    ) -> int | None:
        value = self.raw(name, example, required=required)
        if value is _ABSENT:
            return default
        if not _is_int(value):
            self.wrong_type(name, value, "an integer", example)
            return None
        if not low <= value <= high:
            self.problem(name, value, f"use an integer from {low} to {high}")
            return None
        self.values[name] = value
        return value

    def number(self, name: str, example: str, *, default: float | None = None) -> float | None:
        value = self.raw(name, example)
        if value is _ABSENT:
            return default
        if not _is_number(value):
            self.wrong_type(name, value, "a number", example)
            return None
        self.values[name] = float(value)
        return float(value)

    def items(
        self,
        name: str,
        example: str,
        kind: str,
        accept: Callable[[object], bool],
        *,
        required: bool = False,
        nonempty: bool = False,
        check: Callable[[Any], str | None] | None = None,
    ) -> list[Any] | None:
        """A list whose items all pass `accept` and then `check` (which returns a fix or None);
        each bad item is its own problem."""
        value = self.raw(name, example, required=required)
        if value is _ABSENT:
            return None
        if not isinstance(value, list):
            self.wrong_type(name, value, f"a list of {kind}s", example)
            return None
        good = True
        if nonempty and not value:
            self.problem(name, value, f"list at least one, e.g. {name} = {example}")
            good = False
        article = "an" if kind[0] in "aeiou" else "a"
        for index, item in enumerate(value):
            fix = f"expected {article} {kind}, e.g. {example}" if not accept(item) else None
            fix = fix or (check(item) if check else None)
            if fix:
                self.problem(f"{name}[{index}]", item, fix)
                good = False
        if not good:
            return None
        self.values[name] = value
        return value

    def table(self, name: str, known: tuple[str, ...], *, needs: str = "") -> "_Table | None":
        """The sub-table `name` (empty when absent); None when it is bad or a needed one is
        absent (`needs` says what it must hold)."""
        value = self.data.get(name, _ABSENT)
        if value is _ABSENT and needs:
            self.problem(name, _ABSENT, f"add the [{name}] section with {needs}")
            return None
        if value is _ABSENT:
            value = {}
        if not isinstance(value, dict):
            fix = f"expected a table: write a [{name}] header with its keys on the lines below"
            self.problem(name, value, fix)
            return None
        return _Table(value, self.key(name), f"[{name}]", self.problems, known)

    def tables(self, name: str, known: tuple[str, ...]) -> "list[_Table]":
        """The array of tables `name` ([[name]] entries); empty when absent or bad."""
        value = self.data.get(name, [])
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            fix = f"write each entry as a [[{name}]] header (double brackets) with its keys below"
            self.problem(name, value, fix)
            return []
        path = self.key(name)
        return [
            _Table(item, f"{path}[{index}]", f"[[{name}]]", self.problems, known)
            for index, item in enumerate(value)
        ]


def _validate(document: dict[str, Any], problems: list[ConfigProblem]) -> dict[str, Any]:
    """The document's values ready for msgspec.convert, appending every problem found."""
    root = _Table(document, "", _ROOT_LABEL, problems, _TOP_KEYS)
    _check_dirs(root)
    config: dict[str, Any] = {"node": _check_node(root), "etcd": _check_etcd(root)}
    services: list[tuple[_Table, int]] = []
    checkpoint: _Table | None = None
    for name, (known, default_listen) in _SERVICES.items():
        table = root.table(name, known)
        if table is None:
            continue
        port = _check_listen(table, default_listen)
        if name == "checkpoint":
            _check_checkpoint(table)
            checkpoint = table
        if name == "rpc":
            _check_rpc_tls(table)
        if name == "gateway":
            _check_api_keys(table)
            _check_gateway_limits(table)
        if port is not None:
            services.append((table, port))
        config[name] = table.values
    _check_service_ports(services)
    listen_ports = [(table.key("listen"), port) for table, port in services]
    config["workers"] = _check_workers(root, listen_ports)
    if checkpoint is not None:
        _check_checkpoint_security(checkpoint, has_workers=bool(root.data.get("workers")))
    return {**root.values, **config}


def _check_dirs(root: _Table) -> None:
    for name, default in (("state_dir", "/var/lib/lumen"), ("runtime_dir", "/run/lumen")):
        path = root.text(name, f'"{default}"')
        if path is not None and not os.path.isabs(path):
            root.problem(name, path, f'use an absolute path, e.g. {name} = "{default}"')


def _check_name(table: _Table, key: str, name: str | None) -> None:
    if name is not None and not _NAME_RE.fullmatch(name):
        table.problem(key, name, _NAME_FIX)


def _check_node(root: _Table) -> dict[str, Any]:
    node = root.table("node", _NODE_KEYS, needs='name = "gpu-node-1" and address = "10.0.0.11"')
    if node is None:
        return {}
    _check_name(node, "name", node.text("name", '"gpu-node-1"', required=True))
    address = node.text("address", '"10.0.0.11"', required=True)
    fix = None if address is None else _address_fix(address)
    if fix is not None:
        node.problem("address", address, fix)
    return node.values


def _address_fix(address: str) -> str | None:
    """What is wrong with an advertised node address, or None if it is fine."""
    example = 'e.g. "10.0.0.11" or "gpu-node-1.example.com"'
    if "://" in address:
        return f"remove the scheme: give only the host name or IP address, {example}"
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        ip = None
    if ip is not None and ip.is_unspecified:
        return f"peers cannot reach an unspecified address: give this node's own address, {example}"
    if ip is not None:
        return "remove the brackets around the IPv6 address" if address.startswith("[") else None
    if ":" in address:
        return f"remove the port (each service sets its own in its section), {example}"
    if not _HOSTNAME_RE.fullmatch(address):
        return f"give the host name or IP address peers use to reach this node, {example}"
    return None


def _check_etcd(root: _Table) -> dict[str, Any]:
    etcd = root.table("etcd", _ETCD_KEYS, needs='endpoints = ["http://10.0.0.1:2379"]')
    if etcd is None:
        return {}
    secure, plaintext = _check_endpoints(etcd)
    _check_name(etcd, "cluster", etcd.text("cluster", '"prod"'))
    _check_timings(etcd)
    _check_tls(etcd, secure, plaintext)
    return etcd.values


def _check_endpoints(etcd: _Table) -> tuple[bool, bool]:
    """Checks etcd.endpoints; returns whether any of them uses https, and any http."""
    example = '["http://10.0.0.1:2379"]'
    etcd.items(
        "endpoints", example, "string", _is_str, required=True, nonempty=True, check=_url_fix
    )
    endpoints = etcd.data.get("endpoints")
    urls = [url.lower() for url in endpoints if isinstance(url, str)] \
        if isinstance(endpoints, list) else []
    return (any(url.startswith("https://") for url in urls),
            any(url.startswith("http://") for url in urls))


def _url_fix(url: str) -> str | None:
    try:
        _parse_endpoint(url)
    except ValueError as exc:
        return str(exc)
    return None


def _check_timings(etcd: _Table) -> None:
    ttl = etcd.integer("lease_ttl_s", "10", 2, 300, default=10)
    checks = (
        ("heartbeat_interval_s", "3.0", None, "or remove it to use lease_ttl_s / 3"),
        ("request_timeout_s", "2.0", 2.0, "a request must not outlive the lease renewal window"),
    )
    for name, example, default, why in checks:
        value = etcd.number(name, example, default=default)
        if value is None:
            continue
        limit = float("inf") if ttl is None else ttl / 2
        if not 0 < value < limit:
            fix = "use a number above 0"
            if ttl is not None:
                fix += f" and below lease_ttl_s / 2 ({limit:g}), or raise lease_ttl_s; {why}"
            etcd.problem(name, value, fix, default=name not in etcd.data)


def _check_tls(etcd: _Table, secure: bool, plaintext: bool) -> None:
    """[etcd] ca_cert, cert and key: all three readable files and https:// endpoints (etcd
    as the etcd role runs it: TLS, --client-cert-auth), or none and http:// endpoints."""
    given = []
    for name, example in _TLS_EXAMPLES.items():
        path = etcd.text(name, example)
        if path is None:
            continue
        given.append(name)
        if not os.path.isfile(path):
            etcd.problem(name, path, "no such file; put the file there or remove the key")
        elif not os.access(path, os.R_OK):
            etcd.problem(name, path, "lumend cannot read this file; make it readable by the "
                         "user lumend runs as (the key only by that user)")
    has = {name: name in etcd.data for name in _TLS_EXAMPLES}
    if secure and not has["ca_cert"]:
        etcd.problem("ca_cert", _ABSENT, (
            "https endpoints need the CA certificate of the etcd servers: "
            f"add ca_cert = {_TLS_EXAMPLES['ca_cert']} to [etcd], or use http:// endpoints"))
    elif not has["ca_cert"] and (has["cert"] or has["key"]):
        etcd.problem("ca_cert", _ABSENT, (
            "a client certificate needs the CA certificate of the etcd servers: add "
            f"ca_cert = {_TLS_EXAMPLES['ca_cert']} to [etcd] and use https:// endpoints, "
            "or remove cert and key"))
    for one, lacking in (("cert", "key"), ("key", "cert")):
        if has[one] and not has[lacking]:
            etcd.problem(lacking, _ABSENT, (
                f"a client certificate needs both cert and key: "
                f"add {lacking} = {_TLS_EXAMPLES[lacking]}, or remove {one}"))
    if (secure or has["ca_cert"]) and not (has["cert"] or has["key"]):
        for name in ("cert", "key"):
            etcd.problem(name, _ABSENT, (
                "etcd over TLS needs a client certificate (the etcd role runs etcd with "
                f"--client-cert-auth): add cert = {_TLS_EXAMPLES['cert']} and "
                f"key = {_TLS_EXAMPLES['key']} to [etcd], or remove ca_cert and use "
                "http:// endpoints"))
    if given and plaintext:
        etcd.problem("endpoints", etcd.data.get("endpoints"), (
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} set, but http:// "
            "endpoints would reach etcd in plaintext: use https:// for every endpoint, or "
            f"remove {', '.join(given)}"))


def _check_listen(table: _Table, default: str) -> int | None:
    """Checks table.listen (filling in the default); returns its port when it is good."""
    listen = table.text("listen", f'"{default}"', default=default)
    if listen is None:
        return None
    table.values["listen"] = listen
    try:
        return parse_listen(listen)[1]
    except ValueError as exc:
        table.problem("listen", listen, str(exc))
        return None


def _check_checkpoint(table: _Table) -> None:
    table.choice("eviction", EVICTIONS)
    value = table.raw("budget_bytes", '"20GiB"')
    if value is _ABSENT:
        return
    if isinstance(value, bool) or not isinstance(value, str | int):
        table.problem("budget_bytes", value, _SIZE_HINT)
        return
    try:
        table.values["budget_bytes"] = parse_size(value)
    except ValueError as exc:
        table.problem("budget_bytes", value, str(exc))


def _check_checkpoint_security(table: _Table, *, has_workers: bool) -> None:
    """CURVE on checkpoint sockets is on unless explicitly turned off: a node with workers
    (its holder keeps their peers' pages, its engines stream theirs) needs the cluster's
    key file, readable and private, or `insecure = true`."""
    insecure = table.raw("insecure", "true")
    if insecure is not _ABSENT and not isinstance(insecure, bool):
        table.wrong_type("insecure", insecure, "true or false", "false")
        return
    path = table.text("keys", f'"{_CURVE_KEYS_EXAMPLE}"')
    if insecure is True:
        table.values["insecure"] = True
        if path is not None:
            table.problem("insecure", True, "keys is set too: remove insecure = true to use "
                          "the keys, or remove keys to run without CURVE (tests only)")
        return
    if path is None:
        if has_workers and "keys" not in table.data:
            table.problem("keys", _ABSENT, (
                f'add keys = "{_CURVE_KEYS_EXAMPLE}" to [checkpoint], the cluster\'s CURVE key '
                f"file (create it once with `lumenctl keys generate {_CURVE_KEYS_EXAMPLE}` and "
                "copy it to every node), or insecure = true to send KV pages unauthenticated "
                "and in clear (tests only)"))
        return
    if not os.path.isabs(path):
        table.problem("keys", path, f'use an absolute path, e.g. keys = "{_CURVE_KEYS_EXAMPLE}"')
        return
    try:
        CurveKeys.load(path)
    except KeyFileError as exc:
        table.problem("keys", path, str(exc))


_API_KEYS_EXAMPLE = "/etc/lumen/api-keys"


def _check_api_keys(table: _Table) -> None:
    """[gateway] api_keys: an absolute path to a private, readable key file; absent, the
    gateway is open."""
    path = table.text("api_keys", f'"{_API_KEYS_EXAMPLE}"')
    if path is None:
        return
    if not os.path.isabs(path):
        table.problem("api_keys", path,
                      f'use an absolute path, e.g. api_keys = "{_API_KEYS_EXAMPLE}"')
        return
    try:
        ApiKeys.load(path)
    except ApiKeyFileError as exc:
        table.problem("api_keys", path, str(exc))


def _check_gateway_limits(table: _Table) -> None:
    """[gateway] timeouts (seconds, positive) and max_streams."""
    for name in _GATEWAY_TIMES:
        default = getattr(GatewaySection(), name)
        value = table.number(name, f"{name} = {default:g}")
        if value is not None and not 0 < value <= 86400:
            table.problem(name, value, f"use a number of seconds above 0, e.g. {name} = "
                          f"{default:g}")
    table.integer("max_streams", "max_streams = 1024", 1, 1_000_000)
    drain = table.number("drain_s", "drain_s = 30")
    if drain is not None and not 0 <= drain <= 3600:
        table.problem("drain_s", drain, "use a number of seconds from 0 (stop engines at once) "
                      "to 3600, below systemd's TimeoutStopSec, e.g. drain_s = 30")
    log_admissions = table.raw("log_admissions", "true")
    if log_admissions is not _ABSENT and not isinstance(log_admissions, bool):
        table.wrong_type("log_admissions", log_admissions, "true or false", "false")
    elif log_admissions is not _ABSENT:
        table.values["log_admissions"] = log_admissions


_RPC_TLS_EXAMPLES = {
    "ca": '"/etc/lumen/rpc-ca.pem"',
    "cert": '"/etc/lumen/rpc-node.pem"',
    "key": '"/etc/lumen/rpc-node-key.pem"',
}


def _check_rpc_tls(table: _Table) -> None:
    """[rpc] ca, cert and key: all three readable files (mTLS), or none (plaintext)."""
    given = []
    for name, example in _RPC_TLS_EXAMPLES.items():
        path = table.text(name, example)
        if path is None:
            continue
        given.append(name)
        if not os.path.isfile(path):
            table.problem(name, path, "no such file; put the PEM file there or remove the "
                          "key (without ca, cert and key the control plane is plaintext)")
        elif not os.access(path, os.R_OK):
            table.problem(name, path, "lumend cannot read this file; make it readable by "
                          "the user lumend runs as (the key only by that user)")
    if given and len(given) < len(_RPC_TLS_EXAMPLES):
        for name, example in _RPC_TLS_EXAMPLES.items():
            if name not in table.data:
                table.problem(name, _ABSENT, f"mTLS needs ca, cert and key together: add "
                              f"{name} = {example} to [rpc], or remove "
                              f"{', '.join(given)} for plaintext")


def _check_service_ports(services: list[tuple[_Table, int]]) -> None:
    owners: dict[int, str] = {}
    for table, port in services:
        owner = owners.setdefault(port, table.key("listen"))
        if owner != table.key("listen"):
            fix = f"port {port} is already used by {owner}; give each service its own port"
            table.problem("listen", table.values["listen"], fix, default="listen" not in table.data)


@dataclass(frozen=True, eq=False)
class _Worker:
    """What the checks across workers need to know about one [[workers]] entry."""

    table: _Table
    name: str | None
    gpus: list[int]
    ports: range | None
    model: str | None
    served: tuple[str, ...]  # the names it serves under (none: its model or args are bad)
    served_key: str  # where they come from: "args" (--served-model-name) or "model"

    def __str__(self) -> str:
        return self.table.path if self.name is None else f'{self.table.path} "{self.name}"'


def _check_workers(root: _Table, listen_ports: list[tuple[str, int]]) -> list[dict[str, Any]]:
    workers = [_check_worker(table) for table in root.tables("workers", _WORKER_KEYS)]
    _check_unique_names(workers)
    _check_served_names(workers)
    _check_shared_gpus(workers)
    _check_port_ranges(workers, listen_ports)
    return [worker.table.values for worker in workers]


def _check_worker(table: _Table) -> _Worker:
    name = table.text("name", '"gpu-node-1-w0"', required=True)
    _check_name(table, "name", name)
    gpus = _check_gpus(table)
    engine = table.choice("engine", ENGINES, required=True)
    shadows = table.integer("shadows", "1", 0, 4, default=1)
    good_model: str | None = None
    for key, example, required in (
        ("model", '"/models/Qwen3-32B"', True),
        ("draft_model", '"/models/Qwen3-1.7B"', False),
    ):
        model = table.text(key, example, required=required)
        if model is not None and not model.strip():
            table.problem(key, model, f"give a model path or name, e.g. {key} = {example}")
        elif key == "model" and engine == "sim" and model is not None and model not in SIM_MODELS:
            presets = ", ".join(f'"{m}"' for m in SIM_MODELS)
            table.problem(key, model, f"a sim worker names a sim model preset: {presets}")
        elif (key == "draft_model" and engine == "sim" and model is not None
              and model not in SIM_DRAFTS):
            drafts = ", ".join(f'"{d}"' for d in SIM_DRAFTS)
            table.problem(key, model, f"a sim worker's draft_model names a sim drafter: "
                          f"{drafts} (or leave it out: no draft-assist)")
        elif key == "model":
            good_model = model
    args = table.items("args", '["--tensor-parallel-size", "4"]', "string", _is_str) or []
    served, served_key = _check_served_name(table, args, good_model)
    if engine == "vllm" and shadows and gpus and len(gpus) > 1:
        _check_shared_gpu_fraction(table, args, shadows)
    _check_engine_budget_and_assist(table, engine, args)
    port = table.integer("port", "8100", 1, 65535, required=True)
    return _Worker(table, name, gpus, _engine_ports(table, port, shadows), good_model,
                   served, served_key)


def _check_served_name(table: _Table, args: list[str],
                       model: str | None) -> tuple[tuple[str, ...], str]:
    """The names the worker serves under (WorkerConfig.served_names) and the key they come
    from; none when its args give --served-model-name without a name or its model is bad."""
    given = next((a for a in args if a.partition("=")[0] == "--model"), None)
    if given is not None:
        # lumend passes `model` as --model before the args; a second one wins in the
        # engine's parser, so the engines would serve a model the cluster does not route to
        # them (every request answered 404 by the engine).
        table.problem("args", args, f"{given} in args: the worker's model is its model key "
                      "(lumend gives it to every engine as --model); move the model there, "
                      'e.g. model = "/models/Qwen3-32B", and drop --model from args')
    try:
        names = served_model_names(args)
    except ValueError as exc:
        table.problem("args", args, str(exc))
        return (), "args"
    return (names, "args") if names else (() if model is None else (model,), "model")


def gpu_memory_utilization(args: list[str]) -> float | None:
    """The --gpu-memory-utilization a worker's args give every engine (None: not given, or
    not a number, which vLLM reports itself)."""
    for i, arg in enumerate(args):
        if arg == "--gpu-memory-utilization" and i + 1 < len(args):
            text = args[i + 1]
        elif arg.startswith("--gpu-memory-utilization="):
            text = arg.partition("=")[2]
        else:
            continue
        try:
            return float(text)
        except ValueError:
            return None
    return None


def _check_shared_gpu_fraction(table: _Table, args: list[str], shadows: int) -> None:
    """A multi-GPU vLLM worker with shadows: its engines load their own weights (no GMS),
    and while a shadow initialises the active engine holds its whole fraction of every GPU,
    so two fractions above one half can never fit: vLLM refuses the shadow at start."""
    fraction = gpu_memory_utilization(args)
    if fraction is not None and 2 * fraction > 1:
        table.problem("args", args, f"--gpu-memory-utilization {fraction:g} for each of "
                      f"{shadows + 1} engines on the same GPUs: while a shadow initialises "
                      "the active engine holds its share, so two shares must fit (at most "
                      "0.5 each with room to spare); set kv_cache_bytes instead (lumend "
                      "then asks vLLM for each engine's KV cache + 4 GiB) or lower it")


VLLM_DEFAULT_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization when none is given


def computes_memory_split(worker: WorkerConfig) -> bool:
    """A vLLM worker with shadows whose operator set no memory split (no kv_cache_bytes, no
    --gpu-memory-utilization or --kv-cache-memory-bytes in its args): lumend chooses its
    kv_cache_bytes at engine start (lumend.engine.vllm_memory.default_kv_cache_bytes)."""
    return (worker.engine == "vllm" and worker.shadows > 0 and worker.kv_cache_bytes is None
            and gpu_memory_utilization(worker.args) is None
            and not any(a == "--kv-cache-memory-bytes"
                        or a.startswith("--kv-cache-memory-bytes=") for a in worker.args))


def computed_split_note(worker: WorkerConfig, gpu_total: int | None,
                        weight_bytes: int | None) -> str | None:
    """What lumend will choose for a worker that computes its memory split (None: it does
    not, or cannot here, which memory_split_warnings reports)."""
    if not computes_memory_split(worker) or gpu_total is None or weight_bytes is None:
        return None
    n = len(worker.gpus)
    try:
        kv = default_kv_cache_bytes(gpu_total, weight_bytes, n, worker.shadows)
    except ValueError:
        return None
    return (f"workers {worker.name!r}: no kv_cache_bytes set: lumend will choose "
            f"{describe_kv_choice(kv, gpu_total, weight_bytes, n, worker.shadows)}")


def memory_split_warnings(worker: WorkerConfig, gpu_total: int | None,
                          weight_bytes: int | None) -> list[str]:
    """On a GPU host: whether a vLLM worker's engines fit on its GPUs together. lumend
    starts them one at a time, so at most the active engine and one initialising shadow
    hold KV caches at once (a sleeping shadow holds none). Single GPU: the weights once
    (GMS) + 2 x (kv_cache_bytes + reserve); several: no GMS, so each engine's own share of
    the weights too, 2 x (weights / GPUs + kv_cache_bytes + reserve). `gpu_total` is the
    smallest of its GPUs, `weight_bytes` the model's weights (None: unknown, not checked).
    With no split set lumend computes one (computes_memory_split): a warning only when it
    cannot here (GPU memory or weights unknown) or when none fits."""
    if worker.engine != "vllm" or worker.shadows == 0:
        return []
    where = f"workers {worker.name!r}"
    no_split = (f"{where}: its {worker.shadows + 1} engines share GPUs {worker.gpus} with no "
                "memory split, so each starts with vLLM's default --gpu-memory-utilization "
                f"{VLLM_DEFAULT_UTILIZATION:g} and the shadow cannot start while the active "
                "engine holds its memory")
    if computes_memory_split(worker):
        if gpu_total is None or weight_bytes is None:
            unknown = ("nvidia-smi reports no memory for these GPUs" if gpu_total is None
                       else f"the size of model {worker.model!r} is unknown (not a local "
                       "directory of weight files)")
            return [f"{no_split}: lumend would choose kv_cache_bytes from the GPUs' memory "
                    f"and the model's weights, but {unknown}; set kv_cache_bytes "
                    "(examples/lumend.toml)"]
        try:
            default_kv_cache_bytes(gpu_total, weight_bytes, len(worker.gpus), worker.shadows)
        except ValueError as exc:
            return [f"{where}: no kv_cache_bytes set, and none fits: {exc}"]
        return []
    if worker.kv_cache_bytes is None and gpu_memory_utilization(worker.args) is None:
        return [f"{no_split}; set kv_cache_bytes (examples/lumend.toml)"]
    if worker.kv_cache_bytes is None or gpu_total is None or weight_bytes is None:
        return []
    gib = 1024**3
    kv, reserve, n = worker.kv_cache_bytes, ENGINE_RESERVE_BYTES, len(worker.gpus)
    if n == 1:
        need = weight_bytes + 2 * (kv + reserve)
        fits = (gpu_total - weight_bytes) // 2 - reserve
        how = (f"weights {weight_bytes / gib:.1f} GiB once (GMS) + 2 x (KV "
               f"{kv / gib:.1f} + reserve {reserve / gib:.0f}) GiB")
    else:
        need = 2 * (weight_bytes // n + kv + reserve)
        fits = gpu_total // 2 - weight_bytes // n - reserve
        how = (f"2 x (weights {weight_bytes / n / gib:.1f} GiB per GPU + KV {kv / gib:.1f} + "
               f"reserve {reserve / gib:.0f}) GiB, each engine holding its own weights")
    if need <= gpu_total:
        return []
    advice = (f"lower kv_cache_bytes to at most {fits / gib:.1f} GiB" if fits > 0 else
              "the model does not fit twice: use shadows = 0 or more GPUs")
    return [f"{where}: kv_cache_bytes = {kv / gib:g} GiB does not fit while a shadow "
            f"initialises next to the active engine: {how} = {need / gib:.1f} GiB of a "
            f"{gpu_total / gib:.1f} GiB GPU; {advice}"]


def _check_engine_budget_and_assist(table: _Table, engine: str | None, args: list[str]) -> None:
    """workers[i].assist (a boolean) and kv_cache_bytes (a size above 0); neither may also be
    set through the worker's args, where lumend could not tell which one wins."""

    def in_args(*options: str) -> str | None:
        return next((a for a in args for o in options if a == o or a.startswith(o + "=")), None)

    assist = table.raw("assist", "true")
    if assist is not _ABSENT:
        if not isinstance(assist, bool):
            table.wrong_type("assist", assist, "true or false", "true")
        else:
            table.values["assist"] = assist
            own = in_args("--speculative-config", "-sc")
            if assist and engine == "vllm" and own:
                table.problem("assist", assist, f"args already set {own}: LUMEN's draft-assist "
                              "proposer is a speculative config of its own; remove one of them")
    value = table.raw("kv_cache_bytes", '"8GiB"')
    if value is _ABSENT:
        return
    try:
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise ValueError(_SIZE_HINT)
        size = parse_size(value)
        if size == 0:
            raise ValueError(f"an engine needs some KV cache; {_SIZE_HINT}")
    except ValueError as exc:
        table.problem("kv_cache_bytes", value, str(exc))
        return
    own = in_args("--kv-cache-memory-bytes")
    if own:
        table.problem("kv_cache_bytes", value, f"args already set {own}; keep one of them")
        return
    table.values["kv_cache_bytes"] = size


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _check_gpus(table: _Table) -> list[int]:
    """Checks workers[i].gpus; returns its distinct indices when they are all good."""
    gpus = table.items(
        "gpus", "[0, 1]", "integer", _is_int, required=True, nonempty=True, check=_gpu_fix
    )
    if gpus is None:
        return []
    if len(set(gpus)) != len(gpus):
        table.problem("gpus", gpus, "list each GPU once")
    return sorted(set(gpus))


def _gpu_fix(gpu: int) -> str | None:
    return "GPU indices start at 0 (as nvidia-smi numbers them)" if gpu < 0 else None


def _engine_ports(table: _Table, port: int | None, shadows: int | None) -> range | None:
    if port is None or shadows is None:
        return None
    last = port + shadows
    if last > 65535:
        fix = f"port + shadows ({last}) is above 65535; use a lower port"
        table.problem("port", port, fix)
        return None
    return range(port, last + 1)


def _check_unique_names(workers: list[_Worker]) -> None:
    first: dict[str, _Worker] = {}
    for worker in workers:
        if worker.name is None:
            continue
        owner = first.setdefault(worker.name, worker)
        if owner is not worker:
            fix = f"already used by {owner.table.path}; give each worker its own name"
            worker.table.problem("name", worker.name, fix)


def _check_served_names(workers: list[_Worker]) -> None:
    """Workers that serve under one name (first or other) must load one model: the gateway
    routes a request for that name to any of them, and checkpoints and drafts move between
    them."""
    first: dict[str, _Worker] = {}
    for worker in workers:
        if worker.model is None:
            continue
        for name in worker.served:
            owner = first.setdefault(name, worker)
            if owner is worker or owner.model == worker.model:
                continue
            value = worker.table.values.get(worker.served_key, name)
            worker.table.problem(worker.served_key, value, (
                f"{worker} serves as {name!r} like {owner}, but loads {worker.model!r}, not "
                f"{owner.model!r}: the gateway would route requests for {name!r} to both as "
                f"one model; give one of them another --served-model-name in its args, or "
                f"load the same model in both"))
            break


def _check_shared_gpus(workers: list[_Worker]) -> None:
    owners: dict[int, _Worker] = {}
    for worker in workers:
        shared: dict[str, list[int]] = {}  # owning worker -> the GPUs it already uses
        for gpu in worker.gpus:
            owner = owners.setdefault(gpu, worker)
            if owner is not worker:
                shared.setdefault(str(owner), []).append(gpu)
        for owner_name, gpus in shared.items():
            listed = ", ".join(map(str, gpus))
            what = f"GPU {listed} is" if len(gpus) == 1 else f"GPUs {listed} are"
            fix = f"{what} already used by {owner_name}; give each worker its own GPUs"
            worker.table.problem("gpus", worker.table.data["gpus"], fix)


def _check_port_ranges(workers: list[_Worker], listen_ports: list[tuple[str, int]]) -> None:
    """Each worker's engines use ports port .. port + shadows; they must not collide."""
    ranges = [(worker, worker.ports) for worker in workers if worker.ports is not None]
    for index, (worker, ports) in enumerate(ranges):
        clashes = [f"{key} port {port}" for key, port in listen_ports if port in ports]
        clashes += [
            f"{other} ({_span(other_ports)})"
            for other, other_ports in ranges[:index]
            if _overlap(ports, other_ports)
        ]
        if not clashes:
            continue
        taken = [range(port, port + 1) for _, port in listen_ports]
        taken += [other_ports for other, other_ports in ranges if other is not worker]
        free = _free_port(ports, taken)
        fix = f"ports {_span(ports)} (port .. port + shadows) overlap {', '.join(clashes)}"
        fix += "; give each worker a range of its own" + (f", e.g. port = {free}" if free else "")
        worker.table.problem("port", ports.start, fix)


def _span(ports: range) -> str:
    return str(ports.start) if len(ports) == 1 else f"{ports.start}-{ports[-1]}"


def _overlap(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop


def _free_port(ports: range, taken: list[range]) -> int | None:
    """The lowest start at or above ports.start for a range as wide as ports that is free."""
    start = ports.start
    moved = True
    while moved:
        moved = False
        for other in taken:
            if _overlap(range(start, start + len(ports)), other):
                start, moved = other.stop, True
    return start if start + len(ports) - 1 <= 65535 else None
