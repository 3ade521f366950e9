"""`lumenctl`: the operator's CLI. Reads the cluster from etcd; writes intents for lumend.

Exit codes: 0 ok, 1 the operation failed, 2 usage or config error, 3 etcd unreachable.
"""

from __future__ import annotations

import asyncio
import getpass
import os
import socket
import sys
import time
import tomllib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import msgspec
import typer
from rich.console import Console, RenderableType

from lumenctl import sim_cmd
from lumenctl.render import (
    as_json,
    as_yaml,
    checkpoints_table,
    drain_table,
    events_table,
    status_tables,
)
from lumenctl.report import checkpoints_document, events_document, status_document
from lumend.cluster.keys import Keys
from lumend.cluster.models import ClusterSettings, Event, Intent, decode_value, encode_value
from lumend.cluster.store import (
    Delete,
    EtcdStore,
    KeyValue,
    ModRevisionIs,
    Put,
    StoreConfigError,
    StoreError,
    StoreUnavailable,
    TlsFiles,
)
from lumend.cluster.view import ClusterView, build_view

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_ETCD = 3

DEFAULT_CONFIG = "/etc/lumen/lumend.toml"
DEFAULT_ENDPOINT = "http://127.0.0.1:2379"
DEFAULT_WATCH_S = 2.0

T = TypeVar("T")


class Output(StrEnum):
    table = "table"
    json = "json"
    yaml = "yaml"


@dataclass
class Context:
    endpoints: list[str]
    cluster: str
    output: Output
    tls: TlsFiles
    timeout_s: float
    console: Console

    @property
    def keys(self) -> Keys:
        return Keys(self.cluster)

    def store(self) -> EtcdStore:
        return EtcdStore(self.endpoints, request_timeout_s=self.timeout_s, tls=self.tls)


app = typer.Typer(
    name="lumenctl",
    help="Operate a LUMEN cluster: status, agent, events, checkpoints, drain/undrain, "
    "failover, keys.\n\n"
    "Exit codes: 0 ok, 1 the operation failed, 2 usage or config error, 3 etcd unreachable."
    "\n\n-o/--output goes before the command or after one that prints data (`lumenctl "
    "status -o json`); the other global options before it. Shell completion: `lumenctl "
    "--install-completion` (bash, zsh, fish).",
    no_args_is_help=True,
    add_completion=True,
)


def _version_text() -> str:
    from lumend import __version__

    return f"lumenctl {__version__} (distribution lumen-serving)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(_version_text())
        raise typer.Exit(0)


@app.callback()
def global_options(
    ctx: typer.Context,
    endpoints: str | None = typer.Option(
        None, "--endpoints", envvar="LUMEN_ENDPOINTS",
        help="etcd endpoints, comma-separated (default: etcd.endpoints of --config, else "
        f"{DEFAULT_ENDPOINT}).",
    ),
    cluster: str | None = typer.Option(
        None, "--cluster", envvar="LUMEN_CLUSTER",
        help="Cluster name (default: etcd.cluster of --config, else 'default').",
    ),
    output: Output = typer.Option(Output.table, "--output", "-o", help="Output format."),
    config: Path = typer.Option(
        Path(DEFAULT_CONFIG), "--config", envvar="LUMEN_CONFIG",
        help="A lumend.toml to take etcd endpoints, cluster and TLS files from, if it exists.",
    ),
    timeout_s: float = typer.Option(
        2.0, "--etcd-timeout", help="Per-request etcd timeout, seconds."),
    old_timeout_s: float | None = typer.Option(None, "--timeout", hidden=True),
    ca_cert: Path | None = typer.Option(
        None, "--ca-cert", envvar="LUMEN_ETCD_CA_CERT",
        help="CA certificate of the etcd servers, for https:// endpoints (default: "
        "etcd.ca_cert of --config).",
    ),
    cert: Path | None = typer.Option(
        None, "--cert", envvar="LUMEN_ETCD_CERT",
        help="Client certificate for etcd (default: etcd.cert of --config).",
    ),
    key: Path | None = typer.Option(
        None, "--key", envvar="LUMEN_ETCD_KEY",
        help="Client key for etcd (default: etcd.key of --config).",
    ),
    _version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                  help="Print the version and exit."),
) -> None:
    timeout_s = _renamed(ctx, "--timeout", "--etcd-timeout", "timeout_s", old_timeout_s,
                         timeout_s)
    ctx.obj = _connect(ctx.params, output, timeout_s)


def _connect(params: dict[str, Any], output: Output, timeout_s: float) -> Context:
    """The etcd connection the global options (`params`) and --config's [etcd] give."""
    defaults = _defaults_from_config(params.get("config") or Path(DEFAULT_CONFIG))
    endpoints, ca_cert, cert, key = (params.get(name) for name in
                                     ("endpoints", "ca_cert", "cert", "key"))
    return Context(
        endpoints=[e.strip() for e in endpoints.split(",") if e.strip()] if endpoints
        else defaults.get("endpoints") or [DEFAULT_ENDPOINT],
        cluster=params.get("cluster") or defaults.get("cluster") or "default",
        output=output,
        tls=TlsFiles(str(ca_cert) if ca_cert else defaults.get("ca_cert"),
                     str(cert) if cert else defaults.get("cert"),
                     str(key) if key else defaults.get("key")),
        timeout_s=timeout_s,
        console=Console(no_color=not sys.stdout.isatty(), soft_wrap=not sys.stdout.isatty()),
    )


COMPLETION_TIMEOUT_S = 0.5


def _names(kind: str) -> Callable[[typer.Context, str], list[str]]:
    """Shell completion of a command's target from the cluster: `nodes`, `workers`, both
    (`targets`), or the targets of drain intents (`drained`). Nothing when etcd does not
    answer within COMPLETION_TIMEOUT_S (a completion must not hang the shell)."""

    def complete(ctx: typer.Context, incomplete: str) -> list[str]:
        async def read() -> ClusterView:
            store = EtcdStore(c.endpoints, request_timeout_s=COMPLETION_TIMEOUT_S,
                              retry_budget_s=COMPLETION_TIMEOUT_S, tls=c.tls)
            try:
                return build_view(c.keys, await store.get_prefix(c.keys.root))
            finally:
                await store.close()

        try:
            c = _connect(ctx.find_root().params, Output.table, COMPLETION_TIMEOUT_S)
            view = asyncio.run(read())
        except Exception:  # an unreadable config, etcd out of reach: no suggestions
            return []
        names = {
            "nodes": list(view.nodes),
            "workers": list(view.workers),
            "targets": [*view.nodes, *view.workers],
            "drained": [i.target for i in view.intents if i.kind == "drain"],
        }[kind]
        return sorted(n for n in set(names) if n.startswith(incomplete))

    return complete


def _defaults_from_config(path: Path) -> dict[str, Any]:
    """The [etcd] table of a node config, if one is readable; lumenctl needs nothing else."""
    try:
        with path.open("rb") as f:
            etcd = tomllib.load(f).get("etcd", {})
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        _fail(EXIT_USAGE, f"cannot read {path}: {exc}; fix it or point --config elsewhere")
    return etcd if isinstance(etcd, dict) else {}


def _renamed(ctx: typer.Context, old: str, new: str, new_param: str, old_value: T | None,
             new_value: T) -> T:
    """The value of an option renamed since 0.1: the old name still works, hidden from
    --help, with a warning on stderr; it goes in the next release."""
    if old_value is None:
        return new_value
    source = ctx.get_parameter_source(new_param)
    if source is not None and source.name == "COMMANDLINE":
        _fail(EXIT_USAGE, f"{old} is the deprecated name of {new}: give only {new}")
    typer.echo(f"lumenctl: {old} is deprecated, use {new} (the old name goes in the next "
               "release)", err=True)
    return old_value


def output_option() -> Any:
    """-o/--output after the command, as kubectl users type it (`lumenctl status -o json`),
    on every command that prints data; it overrides the global option."""
    return typer.Option(None, "--output", "-o", help="Output format (also before the "
                        "command).", show_default=False)


def _context(ctx: typer.Context, output: Output | None) -> Context:
    c: Context = ctx.obj
    return c if output is None else replace(c, output=output)


@app.command()
def version() -> None:
    """Print the version (as --version does)."""
    typer.echo(_version_text())


# -- status -----------------------------------------------------------------------------


@app.command()
def status(
    ctx: typer.Context,
    watch: float | None = typer.Option(
        None, "--watch", "-w", metavar="[SECONDS]",
        help=f"Refresh every SECONDS (default {DEFAULT_WATCH_S:g}) until interrupted.",
    ),
    output: Output | None = output_option(),
) -> None:
    """Nodes and workers: state, engines, load, checkpoints, intents; the coordinator."""
    c = _context(ctx, output)
    if watch is not None and watch <= 0:
        _fail(EXIT_USAGE, f"--watch {watch:g}: the interval must be positive")
    if watch is None:
        _emit_status(c, _run(c, lambda store: _read_view(c, store)))
        return
    if c.output is Output.table and sys.stdout.isatty():
        from rich.live import Live

        with Live(console=c.console, auto_refresh=False) as live:
            while True:
                view = _run(c, lambda store: _read_view(c, store))
                live.update(status_tables(status_document(view)), refresh=True)
                _sleep_or_exit(watch)
    while True:
        _emit_status(c, _run(c, lambda store: _read_view(c, store)))
        sys.stdout.flush()
        _sleep_or_exit(watch)


def _emit_status(c: Context, view: ClusterView) -> None:
    # YAML documents end with "---" so that `status --watch -o yaml` is a valid stream.
    _emit(c, status_document(view), status_tables, yaml_end="---")


def _emit(c: Context, doc: dict[str, Any], table: Callable[[dict[str, Any]], RenderableType],
          yaml_end: str | None = None) -> None:
    """One report in the chosen output format; every format renders the same document."""
    if c.output is Output.json:
        typer.echo(as_json(doc))
    elif c.output is Output.yaml:
        typer.echo(as_yaml(doc))
        if yaml_end:
            typer.echo(yaml_end)
    else:
        c.console.print(table(doc))


def _sleep_or_exit(seconds: float) -> None:
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


async def _read_view(c: Context, store: EtcdStore) -> ClusterView:
    return build_view(c.keys, await store.get_prefix(c.keys.root))


# -- events -----------------------------------------------------------------------------


@app.command()
def events(
    ctx: typer.Context,
    limit: int = typer.Option(50, "--limit", "-n", min=1, help="Show the newest N events."),
    watch: float | None = typer.Option(
        None, "--watch", "-w", "--follow", metavar="[SECONDS]",
        help=f"Then follow: print each new event as it is recorded, checking every SECONDS "
        f"(default {DEFAULT_WATCH_S:g}), until interrupted. -o json: one JSON object a line; "
        "-o yaml: one document per event."),
    output: Output | None = output_option(),
) -> None:
    """The cluster's recovery, failover and coordinator history, oldest first."""
    c = _context(ctx, output)
    if watch is not None and watch <= 0:
        _fail(EXIT_USAGE, f"--watch {watch:g}: the interval must be positive")
    view = _run(c, lambda store: _read_view(c, store))
    shown = view.events[-limit:]
    if watch is None:
        _emit(c, events_document(c.cluster, shown), events_table)
        return
    seen = {_event_id(e) for e in view.events}
    for event in shown:
        _emit_event(c, event)
    while True:
        sys.stdout.flush()
        _sleep_or_exit(watch)
        view = _run(c, lambda store: _read_view(c, store))
        for event in view.events:
            if _event_id(event) not in seen:
                seen.add(_event_id(event))
                _emit_event(c, event)


def _event_id(event: Event) -> tuple[float, str, str, str]:
    return event.at, event.kind, event.source, event.message


def _emit_event(c: Context, event: Event) -> None:
    """One event as a line (table), a JSON line, or a YAML document."""
    row = msgspec.to_builtins(event)
    if c.output is Output.json:
        typer.echo(msgspec.json.encode(row).decode())
    elif c.output is Output.yaml:
        typer.echo(as_yaml(row))
        typer.echo("---")
    else:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.at))
        epoch = "" if event.epoch is None else f" epoch {event.epoch}"
        typer.echo(f"{at}  {event.kind}  {event.source}{epoch}  {event.message}")


# -- checkpoints ------------------------------------------------------------------------


@app.command()
def checkpoints(
    ctx: typer.Context,
    watch: float | None = typer.Option(
        None, "--watch", "-w", metavar="[SECONDS]",
        help=f"Refresh every SECONDS (default {DEFAULT_WATCH_S:g}) until interrupted."),
    output: Output | None = output_option(),
) -> None:
    """KV checkpoint holders: bytes held against each budget, requests, balance."""
    c = _context(ctx, output)
    if watch is not None and watch <= 0:
        _fail(EXIT_USAGE, f"--watch {watch:g}: the interval must be positive")
    while True:
        _emit(c, checkpoints_document(_run(c, lambda store: _read_view(c, store))),
              checkpoints_table, yaml_end="---" if watch is not None else None)
        if watch is None:
            return
        sys.stdout.flush()
        _sleep_or_exit(watch)


# -- intents ----------------------------------------------------------------------------


@app.command()
def drain(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="A node or worker name.",
                                 autocompletion=_names("targets")),
    migrate: bool = typer.Option(
        False, "--migrate", help="Also move in-flight requests off it, as a recovery would: "
        "to their checkpoint holders (resume), or recomputed on the least loaded worker."
    ),
    wait: bool = typer.Option(
        False, "--wait", help="Show progress until no request is in flight there (exit 1, "
        "naming what is left, if --wait-timeout passes first)."),
    timeout_s: float = typer.Option(300.0, "--wait-timeout", min=0.0,
                                    help="Seconds --wait waits."),
    old_timeout_s: float | None = typer.Option(None, "--timeout", min=0.0, hidden=True),
    reason: str = typer.Option("", "--reason", help="Recorded with the intent."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    force: bool = typer.Option(
        False, "--force", help="Drain even when it takes the last serving worker of a model "
        "(that model then gets no new requests anywhere)."),
    output: Output | None = output_option(),
) -> None:
    """Stop admitting requests on a node or worker (writes a drain intent). Requests in
    flight there finish where they are, or move elsewhere with --migrate. The intent stays
    until `lumenctl undrain`. Refuses (exit 1) to take the last serving worker of a model
    unless --force."""
    c = _context(ctx, output)
    timeout_s = _renamed(ctx, "--timeout", "--wait-timeout", "timeout_s", old_timeout_s,
                         timeout_s)
    if not force:
        view = _run(c, lambda store: _read_view(c, store))
        lost = last_serving_models(view, target)
        if lost:
            _fail(EXIT_FAILED, f"draining {target} would leave no serving worker for "
                  f"{', '.join(lost)}: new requests for it would fail everywhere. Start or "
                  "undrain another worker of it first, or pass --force")
    _write_intent(c, "drain", target, reason, migrate, yes, workers_only=False)
    if wait:
        _wait_for_drain(c, target, migrate, timeout_s)


def last_serving_models(view: ClusterView, target: str) -> list[str]:
    """Models whose every serving worker is the target or on the target node."""
    serving = [w for w in view.workers.values() if w.state == "serving"]
    taken = {w.model for w in serving if target in (w.name, w.node)}
    left = {w.model for w in serving if target not in (w.name, w.node)}
    return sorted(taken - left)


DRAIN_POLL_S = 0.2
# Empty this long before --wait is satisfied: a gateway whose view has not yet caught up
# with the intent (one HA cycle, at most a second) may still admit a request there.
DRAIN_SETTLE_S = 1.0


def _drain_rows(view: ClusterView, target: str, names: set[str]) -> list[dict[str, Any]]:
    """The target's workers as they are now (a worker seen once stays listed: gone)."""
    names.update(w.name for w in view.workers.values() if target in (w.name, w.node))
    rows = []
    for name in sorted(names):
        w = view.workers.get(name)
        if w is None:
            rows.append({"name": name, "state": "gone", "in_flight": 0, "running": 0,
                         "waiting": 0})
        else:
            rows.append({"name": name, "state": w.state,
                         "in_flight": w.load.running + w.load.waiting,
                         "running": w.load.running, "waiting": w.load.waiting})
    return rows


def _empty(row: dict[str, Any]) -> bool:
    # `serving`: its node has not published the intent yet; `draining`: requests left.
    return row["state"] not in ("serving", "draining") and row["in_flight"] == 0


def _wait_for_drain(c: Context, target: str, migrate: bool, timeout_s: float) -> None:
    view = _run(c, lambda store: _read_view(c, store))
    target_kind = "worker" if target in view.workers else "node"
    names: set[str] = set()
    started = time.monotonic()
    empty_since: float | None = None
    live = c.output is Output.table and sys.stdout.isatty()
    shown: list[tuple[str, str, int]] = []

    def document(outcome: str) -> dict[str, Any]:
        return {"target": target, "target_kind": target_kind, "migrate": migrate,
                "outcome": outcome, "seconds": round(time.monotonic() - started, 3),
                "workers": rows}

    from contextlib import nullcontext

    from rich.live import Live

    with (Live(console=c.console, auto_refresh=False) if live else nullcontext()) as screen:
        while True:
            now = time.monotonic()
            rows = _drain_rows(view, target, names)
            intent = any(i.kind == "drain" and i.target == target for i in view.intents)
            done = all(_empty(r) for r in rows)
            empty_since = (empty_since or now) if done else None
            if screen is not None:
                screen.update(drain_table(document("draining")), refresh=True)
            elif c.output is Output.table:
                current = [(r["name"], r["state"], r["in_flight"]) for r in rows]
                if current != shown:
                    shown = current
                    typer.echo(f"{now - started:6.1f} s  " + "; ".join(
                        f"{r['name']}: {r['state']}, {r['in_flight']} in flight "
                        f"({r['running']} running, {r['waiting']} waiting)" for r in rows))
            if not intent:
                _fail(EXIT_FAILED, f"the drain intent for {target} was withdrawn while "
                      "waiting (`lumenctl undrain`?)")
            if empty_since is not None and now - empty_since >= DRAIN_SETTLE_S:
                break
            if now - started >= timeout_s:
                if c.output is not Output.table:
                    _emit(c, document("timed out"), drain_table)
                left = [r for r in rows if not _empty(r)] or rows
                what = "; ".join(
                    f"{r['name']} is {r['state']} with {r['in_flight']} requests in flight "
                    f"({r['running']} running, {r['waiting']} waiting)" for r in left) or (
                    f"it has no workers, and a drain is done once nothing was in flight "
                    f"for {DRAIN_SETTLE_S:g} s")
                _fail(EXIT_FAILED, f"the drain of {target_kind} {target} did not finish "
                      f"within {timeout_s:g} s: {what}. The intent stays: wait longer, add "
                      f"--migrate, or withdraw it with `lumenctl undrain {target}`")
            time.sleep(DRAIN_POLL_S)
            view = _run(c, lambda store: _read_view(c, store))
    if c.output is Output.table:
        typer.echo(f"drained {target_kind} {target} ({', '.join(r['name'] for r in rows)}): "
                   f"no requests in flight after {time.monotonic() - started:.1f} s")
    else:
        _emit(c, document("drained"), drain_table)


@app.command()
def undrain(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="A node or worker name.",
                                 autocompletion=_names("drained")),
) -> None:
    """Remove a drain intent."""
    _remove_intent(ctx.obj, "drain", target)


@app.command()
def failover(
    ctx: typer.Context,
    worker: str = typer.Argument(..., help="A worker name.", autocompletion=_names("workers")),
    reason: str = typer.Option("", "--reason", help="Recorded with the intent."),
    cancel: bool = typer.Option(False, "--cancel", help="Withdraw a pending failover intent."),
    wait: bool = typer.Option(
        False, "--wait", help="Wait until the worker's node has switched, and report the time."),
    timeout_s: float = typer.Option(120.0, "--wait-timeout", help="Seconds --wait waits."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Hand a worker's serving role to its shadow engine (writes a failover intent): the
    coordinator orders the worker's node (Agent Failover, with its epoch), which lets the
    active engine finish, release the failover lock and a shadow take over, once."""
    c: Context = ctx.obj
    if cancel:
        _remove_intent(c, "failover", worker)
        return
    requested_at = _write_intent(c, "failover", worker, reason, False, yes, workers_only=True)
    if wait:
        _wait_for_failover(c, worker, requested_at, timeout_s)


def _wait_for_failover(c: Context, worker: str, requested_at: float, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = _run(c, lambda store: _read_view(c, store))
        for event in reversed(view.events):
            if (event.kind in ("failover_done", "failover_refused")
                    and event.at >= requested_at and f"failover of {worker}" in event.message):
                typer.echo(event.message)
                if event.kind == "failover_refused":
                    raise typer.Exit(EXIT_FAILED)
                return
        time.sleep(0.1)
    _fail(EXIT_FAILED, f"no node carried out the failover of {worker} within {timeout_s:g} s; "
          "the intent stays (see `lumenctl status`; withdraw it with --cancel)")


# -- agent (a node's live status over gRPC) ----------------------------------------------


@app.command()
def agent(
    ctx: typer.Context,
    node: str = typer.Argument(..., help="A node name (its gRPC address is read from etcd).",
                               autocompletion=_names("nodes")),
    rpc_ca: Path | None = typer.Option(
        None, "--rpc-ca", help="CA certificate of the nodes' gRPC (default: rpc.ca of "
        "--config). With --rpc-cert and --rpc-key: mTLS; with none of them and no "
        "rpc.ca/cert/key in --config: plaintext."),
    rpc_cert: Path | None = typer.Option(
        None, "--rpc-cert", help="Client certificate signed by that CA (default: rpc.cert "
        "of --config)."),
    rpc_key: Path | None = typer.Option(
        None, "--rpc-key", help="Its private key (default: rpc.key of --config)."),
    rpc_timeout_s: float = typer.Option(3.0, "--rpc-timeout", min=0.1,
                                        help="Seconds to wait for the node's answer."),
    output: Output | None = output_option(),
) -> None:
    """A node's live status from its own lumend (Agent Status over gRPC, not etcd): its
    workers and engines as the node sees them now, the drained workers, the highest
    coordinator epoch it has seen and the commands it refused for a stale epoch."""
    from lumend.rpc.tls import RpcTls

    c = _context(ctx, output)
    config_path: Path = ctx.find_root().params.get("config") or Path(DEFAULT_CONFIG)
    files = _rpc_tls_files(config_path, rpc_ca, rpc_cert, rpc_key)
    tls = RpcTls(*files) if files is not None else None
    view = _run(c, lambda store: _read_view(c, store))
    record = view.nodes.get(node)
    if record is None:
        _fail(EXIT_FAILED, f"no node named {node!r} in cluster {c.cluster!r} (it is not "
              "registered: stopped, or its lease expired); `lumenctl status` lists them")
    status = _agent_status(record.rpc, node, tls, rpc_timeout_s)
    doc = {
        "node": status.node, "address": record.rpc, "tls": tls is not None,
        "highest_epoch": status.highest_epoch, "status": status.status,
        "stale_refused": status.stale_refused,
        "workers": [{"name": w.name, "state": w.state, "model": w.model,
                     "drained": w.drained, "running": w.running, "waiting": w.waiting,
                     "engines": [{"id": e.id, "role": e.role, "state": e.state,
                                  "url": e.url, "pid": e.pid} for e in w.engines]}
                    for w in status.workers],
    }
    _emit(c, doc, _agent_table)


def _rpc_tls_files(config: Path, ca: Path | None, cert: Path | None,
                   key: Path | None) -> tuple[str, str, str] | None:
    """(ca, cert, key) for mTLS from the flags, else from [rpc] of the node config; None:
    plaintext. Exits 2 naming what is missing or unreadable."""
    try:
        with config.open("rb") as f:
            rpc = tomllib.load(f).get("rpc", {})
    except FileNotFoundError:
        rpc = {}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        _fail(EXIT_USAGE, f"cannot read {config}: {exc}; fix it or point --config elsewhere")
    rpc = rpc if isinstance(rpc, dict) else {}
    chosen = {"ca": ca or rpc.get("ca"), "cert": cert or rpc.get("cert"),
              "key": key or rpc.get("key")}
    given = {k: str(v) for k, v in chosen.items() if v}
    if not given:
        return None
    if len(given) < 3:
        missing = ", ".join(f"--rpc-{k}" for k in chosen if k not in given)
        _fail(EXIT_USAGE, f"mTLS needs a CA, a certificate and a key together: {missing} "
              "missing (give all three flags, or --config naming a lumend.toml whose [rpc] "
              "has ca, cert and key)")
    for k, path in given.items():
        try:
            Path(path).read_bytes()
        except OSError as exc:
            _fail(EXIT_USAGE, f"--rpc-{k} {path}: cannot read it ({exc.strerror}); give a "
                  "readable PEM file")
    return given["ca"], given["cert"], given["key"]


def _agent_status(address: str, node: str, tls: Any, timeout_s: float) -> Any:
    from lumend.rpc.client import AgentClient, RpcFailure

    async def ask() -> Any:
        client = AgentClient(address, tls)
        try:
            return await client.status(timeout_s=timeout_s)
        finally:
            await client.close()

    try:
        return asyncio.run(ask())
    except RpcFailure as exc:
        details = exc.details
        lowered = details.lower()
        if "handshake" in lowered or "certificate" in lowered or "ssl" in lowered:
            hint = ("the TLS handshake failed: lumenctl and the node do not trust each "
                    "other's certificates (same CA for both?), or the node serves plaintext "
                    "(then drop the --rpc-* flags)")
        elif "socket closed" in lowered or "connection reset" in lowered:
            hint = ("the node closed the connection: it serves mTLS and refused lumenctl "
                    + ("without a client certificate; pass --rpc-ca, --rpc-cert and --rpc-key "
                       "(or --config with [rpc] ca, cert and key)" if tls is None else
                       "'s certificate (signed by a CA the node does not trust?)"))
        elif exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            hint = (f"nothing answered there within {timeout_s:g} s: is lumend running on "
                    f"{node} (`systemctl status lumend`) and the port reachable from here?")
        else:
            hint = "the node refused the call"
        _fail(EXIT_FAILED, f"node {node}'s agent at {address}: {hint} ({exc.code}: {details})")


def _agent_table(doc: dict[str, Any]) -> RenderableType:
    from rich.table import Table

    table = Table(
        title=f"node {doc['node']} (live, gRPC at {doc['address']}, "
        f"{'mTLS' if doc['tls'] else 'plaintext'}): highest coordinator epoch seen "
        f"{doc['highest_epoch']}, {doc['stale_refused']} stale commands refused",
        caption=doc["status"])
    for column in ("worker", "state", "model", "drained", "running", "waiting", "engines"):
        table.add_column(column)
    for w in doc["workers"]:
        engines = ", ".join(f"{e['id']}:{e['role']}:{e['state']}"
                            + (f" pid {e['pid']}" if e["pid"] else "") for e in w["engines"])
        table.add_row(w["name"], w["state"], w["model"], "yes" if w["drained"] else "no",
                      str(w["running"]), str(w["waiting"]), engines or "-")
    return table


def _write_intent(
    c: Context, kind: str, target: str, reason: str, migrate: bool, yes: bool,
    *, workers_only: bool,
) -> float:
    """Write the intent (and its event); returns the time it was requested."""
    view = _run(c, lambda store: _read_view(c, store))
    if target in view.workers:
        target_kind = "worker"
    elif target in view.nodes and not workers_only:
        target_kind = "node"
    else:
        what = "worker" if workers_only else "node or worker"
        _fail(EXIT_FAILED, f"no {what} named {target!r} in cluster {c.cluster!r}; "
              "`lumenctl status` lists them")
    if not yes:
        if not sys.stdin.isatty():
            _fail(EXIT_USAGE, f"refusing to {kind} {target} without confirmation: pass --yes")
        if not typer.confirm(f"{kind} {target_kind} {target}?"):
            _fail(EXIT_FAILED, "cancelled")
    requester = f"{getpass.getuser()}@{socket.gethostname()}"
    now = time.time()
    intent = Intent(
        kind=kind,  # type: ignore[arg-type]  # one of keys.INTENT_KINDS, checked by Keys.intent
        target=target, target_kind=target_kind,  # type: ignore[arg-type]
        requested_at=now, requested_by=requester, reason=reason, migrate=migrate,
    )
    event = Event(at=now, kind=f"{kind}_requested", source="lumenctl",
                  message=f"{requester} requested {kind} of {target_kind} {target}"
                  + (f": {reason}" if reason else ""))
    key = c.keys.intent(kind, target)
    event_key = c.keys.event(int(now * 1000), "lumenctl", os.getpid() % 10000)

    async def write(store: EtcdStore) -> None:
        await store.txn([], [Put(key, encode_value(intent)), Put(event_key, encode_value(event))])

    _run(c, write)
    typer.echo(f"{kind} intent written for {target_kind} {target}")
    return now


def _remove_intent(c: Context, kind: str, target: str) -> None:
    key = c.keys.intent(kind, target)

    async def remove(store: EtcdStore) -> bool:
        existing = await store.get(key)
        if existing is None:
            return False
        now = time.time()
        event = Event(at=now, kind=f"{kind}_withdrawn", source="lumenctl",
                      message=f"{kind} intent for {target} withdrawn")
        event_key = c.keys.event(int(now * 1000), "lumenctl", os.getpid() % 10000)
        await store.txn([], [Delete(key), Put(event_key, encode_value(event))])
        return True

    if not _run(c, remove):
        _fail(EXIT_FAILED, f"no {kind} intent for {target!r} in cluster {c.cluster!r}")
    typer.echo(f"{kind} intent removed for {target}")


# -- keys -------------------------------------------------------------------------------

keys_app = typer.Typer(help="The cluster's CURVE keys for checkpoint sockets.",
                       no_args_is_help=True)
app.add_typer(keys_app, name="keys")


@keys_app.command("generate")
def keys_generate(
    path: Path = typer.Argument(..., help="Where to write the key file, e.g. "
                                "/etc/lumen/checkpoint.keys."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Write a new cluster key file (mode 0600): copy the same file to every node and set
    checkpoint.keys in lumend.toml to its path. Replacing it needs every node restarted."""
    from lumend.checkpoint.security import CurveKeys

    try:
        CurveKeys.generate().write(path, force=force)
    except FileExistsError:
        _fail(EXIT_FAILED, f"{path} already exists; pass --force to replace it (every node "
              "then needs the new file and a restart)")
    except OSError as exc:
        _fail(EXIT_FAILED, f"cannot write {path} ({exc.strerror}); choose a writable path")
    typer.echo(f"wrote CURVE keys to {path} (mode 0600); copy it to every node, owned by "
               "the lumend user, and set [checkpoint] keys to its path")


# -- config (cluster policy settings) ----------------------------------------------------

config_app = typer.Typer(
    help="Cluster-wide policy settings (etcd `config`): decisions, costs, assist_objective, "
    "alpha, beta, theta, tau, mode. The coordinator reads them every cycle, so a change "
    "applies to its next decisions.",
    no_args_is_help=True,
)
app.add_typer(config_app, name="config")


async def _read_settings(c: Context, store: EtcdStore) -> ClusterSettings:
    from lumend.coordinator.settings import SettingError, check

    kv = await store.get(c.keys.config)
    if kv is None:
        return ClusterSettings()
    try:
        return check(decode_value(kv.value, ClusterSettings))
    except (msgspec.DecodeError, msgspec.ValidationError, SettingError) as exc:
        typer.echo(f"lumenctl: the stored config is invalid ({exc}); the coordinator uses the "
                   "defaults. `lumenctl config set` writes a valid one.", err=True)
        return ClusterSettings()


@config_app.command("show")
def config_show(ctx: typer.Context, output: Output | None = output_option()) -> None:
    """Every setting, its value, whether it is the default, and what it does; then the cost
    figures cost-aware decisions use (restore bandwidth, prefill seconds per token, KV bytes
    per token): measured from the workers' engines, as the coordinator measures them from
    the same records, or the default constant until an engine has measured one; then
    draft-assist's predicted gain per serving worker, as the coordinator last published
    it (recent step time, verify cost, tokens per round)."""
    from lumend.coordinator.settings import as_rows, costs_in_use

    c = _context(ctx, output)

    async def read(store: EtcdStore) -> tuple[ClusterSettings, ClusterView]:
        return await _read_settings(c, store), await _read_view(c, store)

    settings, view = _run(c, read)
    costs = costs_in_use(settings, view.workers.values())
    now = time.time()
    estimates = view.assist_estimates
    assist = None if estimates is None else {
        "at": estimates.at, "age_s": max(0.0, now - estimates.at), "epoch": estimates.epoch,
        "current": view.coordinator is not None and view.coordinator.epoch == estimates.epoch,
        "workers": [msgspec.to_builtins(w) for w in estimates.workers]}
    _emit(c, {"cluster": c.cluster, "settings": as_rows(settings),
              "costs_used": settings.decisions == "cost_aware",
              "costs": costs.rows(now), "assist": assist}, _settings_table)


def _settings_table(doc: dict[str, Any]) -> RenderableType:
    from rich.console import Group
    from rich.table import Table

    table = Table(title=f"cluster {doc['cluster']}: policy settings")
    for column in ("key", "value", "", "meaning"):
        table.add_column(column)
    for row in doc["settings"]:
        table.add_row(row["key"], f"{row['value']:g}" if isinstance(row["value"], float)
                      else str(row["value"]), "(default)" if row["default"] else "",
                      row["meaning"])
    if "costs" not in doc:
        return table
    used = "" if doc["costs_used"] else " (not used: decisions paper)"
    costs = Table(title=f"cost model of cost-aware decisions{used}")
    for column in ("key", "value", "source", "age", "meaning"):
        costs.add_column(column)
    for row in doc["costs"]:
        held = row.get("held")
        fitted = f", fitted from {row['fit_steps']} steps" if row.get("fit_steps") else ""
        source = (f"measured from {row['workers']} worker{'s' if row['workers'] != 1 else ''}"
                  f"{fitted}" if row["source"] == "measured" else
                  f"default constant (measured {held['value']:.4g}, not used until "
                  f"{held['waits_for']} is measured too)" if held else "default constant")
        age = "" if row["age_s"] is None else f"{row['age_s']:.0f} s"
        costs.add_row(row["key"], f"{row['value']:.4g}", source, age, row["meaning"])
    assist = doc.get("assist")
    if assist is None:
        return Group(table, costs)
    stale = "" if assist["current"] else ", by a former coordinator"
    steps = Table(title=f"draft-assist's predicted gain per serving worker (the "
                        f"coordinator's, {assist['age_s']:.0f} s old{stale})")
    for column in ("worker", "step", "verify adds", "tokens/round", "gain", "inputs"):
        steps.add_column(column)

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.2g} ms"

    for w in assist["workers"]:
        steps.add_row(w["worker"], ms(w["step_s"]), ms(w["verify_extra_s"]),
                      f"{w['tokens_per_round']:.2g}",
                      "-" if w["gain"] is None else f"{w['gain']:+.2g}", w["inputs"])
    return Group(table, costs, steps)


SETTINGS = ClusterSettings.__struct_fields__  # the keys of lumend.coordinator.settings


def _complete_setting(incomplete: str) -> list[str]:
    return [key for key in SETTINGS if key.startswith(incomplete)]


def setting_argument() -> Any:
    return typer.Argument(..., help=f"One of {', '.join(SETTINGS)} (`lumenctl config show` "
                          "says what each does).", autocompletion=_complete_setting,
                          show_default=False)


@config_app.command("get")
def config_get(ctx: typer.Context, key: str = setting_argument(),
               output: Output | None = output_option()) -> None:
    """Print one setting's value."""
    from lumend.coordinator.settings import KEYS

    c = _context(ctx, output)
    if key not in KEYS:
        _fail(EXIT_USAGE, f"unknown setting {key!r}; the settings are: {', '.join(KEYS)}")
    value = getattr(_run(c, lambda store: _read_settings(c, store)), key)
    if c.output is Output.table:
        typer.echo(value)
    else:
        _emit(c, {"key": key, "value": value}, _settings_table)


@config_app.command("set")
def config_set(
    ctx: typer.Context,
    key: str = setting_argument(),
    value: str = typer.Argument(..., help="The new value."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Change a setting; the coordinator applies it from its next decision on. Shows the
    change and asks first (--yes: do not ask); refuses, changing nothing, when someone else
    changed the settings between the read and the write."""
    from lumend.coordinator.settings import parse_setting

    c: Context = ctx.obj

    async def read(store: EtcdStore) -> tuple[ClusterSettings, KeyValue | None]:
        return await _read_settings(c, store), await store.get(c.keys.config)

    current, stored = _run(c, read)
    try:
        updated = parse_setting(current, key, value)
    except ValueError as exc:  # a SettingError: names the setting and what it accepts
        _fail(EXIT_USAGE, str(exc))
    before, after = getattr(current, key), getattr(updated, key)
    if before == after:
        typer.echo(f"{key} is already {after} in cluster {c.cluster!r}: nothing to change")
        return
    typer.echo(f"cluster {c.cluster!r}, policy settings:\n  - {key} = {before}\n"
               f"  + {key} = {after}")
    if not yes:
        if not sys.stdin.isatty():
            _fail(EXIT_USAGE, f"refusing to set {key} without confirmation: pass --yes")
        if not typer.confirm("apply?"):
            _fail(EXIT_FAILED, "cancelled")

    async def write(store: EtcdStore) -> str | None:
        # Compare-and-swap: one transaction, conditional on the `config` key's mod revision
        # as it was read when the change was shown (0: still absent). A write by anyone in
        # between fails it and nothing is written. None: written; else what changed.
        now = time.time()
        event = Event(at=now, kind="config_changed", source="lumenctl",
                      message=f"{getpass.getuser()}@{socket.gethostname()} set {key} = "
                      f"{after} (was {before})")
        event_key = c.keys.event(int(now * 1000), "lumenctl", os.getpid() % 10000)
        revision = 0 if stored is None else stored.mod_revision
        result = await store.txn([ModRevisionIs(c.keys.config, revision)],
                                 [Put(c.keys.config, encode_value(updated)),
                                  Put(event_key, encode_value(event))],
                                 read_on_failure=[c.keys.config])
        if result.succeeded:
            return None
        return _config_changed(stored, result.read.get(c.keys.config), current) or (
            "the config key was written again")

    changed = _run(c, write)
    if changed is not None:
        _fail(EXIT_FAILED, f"the settings of cluster {c.cluster!r} changed after they were "
              f"read and shown here: {changed}. Nothing was written; run `lumenctl config "
              f"set {key} {value}` again to see the change against the new settings")
    typer.echo(f"{key} = {after} (was {before}) in cluster {c.cluster!r}")


def _config_changed(read: KeyValue | None, now: KeyValue | None, shown: ClusterSettings
                    ) -> str | None:
    """What changed in the stored `config` key between `read` (as read when the diff was
    shown; None: absent) and `now`, against the settings shown; None: nothing changed."""
    from lumend.coordinator.settings import SettingError, check

    if read is None and now is None:
        return None
    if read is not None and now is not None and read.mod_revision == now.mod_revision:
        return None
    if now is None:
        assert read is not None
        return f"the config key was deleted (it was at revision {read.mod_revision})"
    was = "absent" if read is None else f"at revision {read.mod_revision}"
    where = f"the config key, {was} then, is at revision {now.mod_revision} now"
    try:
        stored = check(decode_value(now.value, ClusterSettings))
    except (msgspec.DecodeError, msgspec.ValidationError, SettingError):
        return f"{where}, with a value that is not valid settings"
    diffs = [f"{name} {getattr(shown, name)} -> {getattr(stored, name)}"
             for name in ClusterSettings.__struct_fields__
             if getattr(shown, name) != getattr(stored, name)]
    return f"{where} ({', '.join(diffs) if diffs else 'the same values written again'})"


# -- demo -------------------------------------------------------------------------------

# The demo's comparison, in the order the table shows (stop_and_restart is the baseline).
POLICIES = ("stop_and_restart", "fixed_checkpoint", "lumen")


@app.command()
def demo(
    ctx: typer.Context,
    nodes: int = typer.Option(4, "--nodes", min=3, max=9,
                              help="lumend nodes to start, one sim worker each."),
    lease_ttl_s: int = typer.Option(3, "--lease-ttl", min=2, help="Node lease TTL, seconds."),
    keep: bool = typer.Option(False, "--keep", help="Leave the cluster running until Ctrl-C."),
    short: bool = typer.Option(False, "--short", help="Only the policy comparison: skip the "
                               "shadow takeover, planned failover and coordinator steps."),
    policies: str = typer.Option(",".join(POLICIES), "--policies",
                                 help="Comma-separated policies to compare, in order."),
    trace_s: float = typer.Option(28.0, "--trace", min=4.0,
                                  help="Length of each policy's trace, seconds."),
    fault_at_s: float = typer.Option(12.0, "--fault-at", min=1.0,
                                     help="When the fault hits, seconds into the trace."),
    rate: float = typer.Option(3.0, "--rate", min=0.1, help="Requests per second."),
    time_scale: float = typer.Option(8.0, "--time-scale", min=0.1, help="Sim engine "
                                     "slowdown (the machine must keep up with it)."),
) -> None:
    """The LUMEN story on a local cluster (embedded etcd, NODES lumend nodes with sim
    engines): SIGKILL an active engine under load (its shadow takes over), a planned
    failover, SIGKILL the coordinator (another takes over) and SIGTERM the next (it hands
    over); then the same trace and the same fault (SIGKILL of the last node's engine, which
    has no shadow) under each policy, set live with `lumenctl config set mode`, with a live
    view of checkpoint placement, recovery decisions, TTFT and TPOT, and a closing table.
    About 3 minutes on two cores. Needs the etcd binary."""
    from lumenctl.demo import DemoOptions, run_demo
    from lumenctl.localcluster import etcd_binary

    try:
        etcd_binary()
    except RuntimeError as exc:
        _fail(EXIT_USAGE, str(exc))
    chosen = tuple(p.strip() for p in policies.split(",") if p.strip())
    unknown = [p for p in chosen if p not in POLICIES]
    if unknown or not chosen:
        _fail(EXIT_USAGE, f"--policies {policies!r}: choose from {', '.join(POLICIES)}")
    if fault_at_s >= trace_s:
        _fail(EXIT_USAGE, f"--fault-at {fault_at_s:g} must be within --trace {trace_s:g}")
    c: Context = ctx.obj
    options = DemoOptions(nodes=nodes, lease_ttl_s=lease_ttl_s, keep=keep, short=short,
                          policies=chosen, trace_s=trace_s, fault_at_s=fault_at_s,
                          warmup_s=min(5.0, fault_at_s / 2), rate=rate, time_scale=time_scale)
    try:
        run_demo(c.console, options)
    except (TimeoutError, RuntimeError) as exc:
        _fail(EXIT_FAILED, f"demo failed: {exc}")


sim_cmd.register(app)


# -- plumbing ---------------------------------------------------------------------------


def _run(c: Context, action: Callable[[EtcdStore], Awaitable[T]]) -> T:
    async def go() -> T:
        store = c.store()
        try:
            return await action(store)
        finally:
            await store.close()

    try:
        return asyncio.run(go())
    except StoreUnavailable as exc:
        _fail(EXIT_ETCD, str(exc))
    except StoreConfigError as exc:
        _fail(EXIT_USAGE, str(exc))
    except StoreError as exc:
        _fail(EXIT_FAILED, str(exc))
    except ValueError as exc:  # a malformed endpoint
        _fail(EXIT_USAGE, str(exc))


def _fail(code: int, message: str) -> NoReturn:
    typer.echo(f"lumenctl: {message}", err=True)
    raise typer.Exit(code)


def _normalize_argv(argv: list[str]) -> list[str]:
    """Let `--watch` stand alone (`status --watch`) as well as take SECONDS."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg in ("--watch", "-w", "--follow"):
            following = argv[i + 1] if i + 1 < len(argv) else None
            if following is None or not _is_number(following):
                out.append(str(DEFAULT_WATCH_S))
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def main() -> None:
    sys.argv[1:] = _normalize_argv(sys.argv[1:])
    app()
