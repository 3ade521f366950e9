"""Rendering of report documents: rich tables for people, JSON/YAML for programs."""

from __future__ import annotations

import json
import time
from typing import Any

import yaml
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text


def as_json(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=False)


def as_yaml(document: dict[str, Any]) -> str:
    return yaml.safe_dump(document, sort_keys=False)


def status_tables(doc: dict[str, Any]) -> RenderableType:
    coordinator = doc["coordinator"]
    if coordinator is None:
        head = Text(f"cluster {doc['cluster']}: no coordinator elected", style="bold red")
    else:
        head = Text(
            f"cluster {doc['cluster']}: coordinator {coordinator['node']} "
            f"(epoch {coordinator['epoch']})",
            style="bold",
        )
        if coordinator["decision"]:
            head.append(f"\n  {coordinator['decision']}", style="dim")

    etcd = doc.get("etcd")
    if etcd is not None:
        head.append(f"\n  etcd {etcd['endpoint']}: database {_size(etcd['db_size_bytes'])}",
                    style="dim")
        for alarm in etcd["alarms"]:
            head.append(f"\n  etcd alarm {alarm}: etcd refuses writes until it is cleared",
                        style="bold red")
        if etcd["fix"]:
            head.append(f"\n  to clear it: {etcd['fix']}", style="red")

    nodes = Table(title="nodes", title_justify="left", expand=False)
    for column in ("NODE", "ADDRESS", "STATE", "WORKERS", "INTENTS", "SEEN", "STATUS"):
        nodes.add_column(column)
    for n in doc["nodes"]:
        nodes.add_row(
            n["name"], n["address"], n["state"], str(len(n["workers"])),
            _intents(n["intents"]), _age(n["updated_at"]), n["status"],
        )

    workers = Table(title="workers", title_justify="left", expand=False)
    for column in ("WORKER", "NODE", "STATE", "ENGINES", "LOAD", "CHECKPOINTS", "INTENTS"):
        workers.add_column(column)
    for w in doc["workers"]:
        workers.add_row(
            w["name"], w["node"],
            w["state"] + (f" (stalled: {w['stalled']})" if w.get("stalled") else ""),
            _engines(w["engines"]), _load(w["load"]),
            _checkpoints(w["checkpoints"]), _intents(w["intents"]),
        )

    parts: list[RenderableType] = [head, nodes, workers]
    if doc.get("assists"):
        assists = Table(title="draft-assist (Algorithm 3)", title_justify="left", expand=False)
        for column in ("RECOVERING", "DRAFTS FOR", "DRAFTER", "ACCEPTANCE", "SINCE"):
            assists.add_column(column)
        for a in doc["assists"]:
            acceptance = ("-" if a["acceptance"] is None else
                          f"{a['acceptance'] * 100:.0f}% ({a['accepted_tokens']}/"
                          f"{a['drafted_tokens']})")
            assists.add_row(a["recovering"], a["survivor"], a["endpoint"], acceptance,
                            _age(a["assigned_at"]))
        parts.append(assists)
    if doc.get("recoveries"):
        parts.append(_recoveries(doc["recoveries"]))
    if doc["problems"]:
        problems = Text("skipped values under the prefix:\n", style="yellow")
        for p in doc["problems"]:
            problems.append(f"  {p['key']}: {p['reason']}\n")
        parts.append(problems)
    return Group(*parts)


def _recoveries(plans: list[dict[str, Any]]) -> Table:
    """One row per recovery plan: where the interrupted requests of a worker went."""
    table = Table(title="recovery plans (Algorithm 2)", title_justify="left", expand=False)
    for column in ("WORKER", "CAUSE", "SINCE", "REQUESTS", "RESUMED", "RECOMPUTED", "ROUTED TO",
                   "STATE"):
        table.add_column(column)
    for p in plans:
        routed = ", ".join(f"{w} {n}" for w, n in sorted(p["targets"].items())) or "-"
        back = p["served_again_at"]
        state = "recovering" if back is None else f"serving again {_age(back)}"
        table.add_row(p["worker"], p["cause"], _age(p["failed_at"]), str(p["total"]),
                      str(p["resumed"]), str(p["recomputed"]), routed, state)
    return table


def checkpoints_table(doc: dict[str, Any]) -> RenderableType:
    table = Table(title=f"checkpoint holders in cluster {doc['cluster']}", title_justify="left")
    for column in ("WORKER", "NODE", "HELD", "BUDGET", "FILL", "REQUESTS", "COVERAGE"):
        table.add_column(column)
    for h in doc["holders"]:
        fill = "-" if h["fill"] is None else f"{h['fill'] * 100:.1f}%"
        table.add_row(h["worker"], h["node"], _size(h["bytes_held"]), _size(h["budget_bytes"]),
                      fill, str(h["requests"]), _coverage(h))
    balance = doc["balance_ratio"]
    caption = (f"{_size(doc['bytes_held'])} in {doc['requests']} checkpoints; balance "
               f"(max/min held) {'-' if balance is None else f'{balance:.2f}'}; coverage "
               f"{_coverage(doc)}")
    if doc["coverage_unknown"]:
        caption += (f" (unknown for {', '.join(doc['coverage_unknown'])}: the engine reports "
                    "no lumen_ckpt_requests_* gauges)")
    return Group(table, Text(caption))


def _coverage(row: dict[str, Any]) -> str:
    """"93.8% (15/16)" of running requests; "-" when none run; "unknown" when not reported."""
    running = row["requests_running"]
    if running is None:
        return "unknown"
    if row["coverage"] is None:
        return "-"
    return f"{row['coverage'] * 100:.1f}% ({row['requests_checkpointed']}/{running})"


def events_table(doc: dict[str, Any]) -> RenderableType:
    table = Table(title=f"events in cluster {doc['cluster']}", title_justify="left")
    for column in ("TIME", "KIND", "SOURCE", "EPOCH", "MESSAGE"):
        table.add_column(column)
    for e in doc["events"]:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["at"]))
        epoch = "" if e.get("epoch") is None else str(e["epoch"])
        table.add_row(at, e["kind"], e["source"], epoch, e["message"])
    return table


def _engines(engines: list[dict[str, Any]]) -> str:
    if not engines:
        return "-"
    return " ".join(f"{e['id'].rsplit('/', 1)[-1]}:{e['state']}" for e in engines)


def _load(load: dict[str, Any]) -> str:
    return f"{load['running']} run / {load['waiting']} wait / kv {load['kv_usage'] * 100:.0f}%"


def _checkpoints(ckpt: dict[str, Any]) -> str:
    return f"{_size(ckpt['bytes_held'])} / {_size(ckpt['budget_bytes'])}"


def _intents(intents: list[dict[str, Any]]) -> str:
    return ", ".join(f"{i['kind']}{' (migrate)' if i['migrate'] else ''}" for i in intents) or "-"


def _age(at: float) -> str:
    seconds = max(0.0, time.time() - at)
    return f"{seconds:.0f}s ago"


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{n}B"


def drain_table(doc: dict[str, Any]) -> RenderableType:
    """`lumenctl drain --wait`: each worker of the target and what is left on it."""
    migrate = " --migrate" if doc["migrate"] else ""
    table = Table(title=f"drain{migrate} of {doc['target_kind']} {doc['target']}: "
                  f"{doc['outcome']} after {doc['seconds']:.1f} s", title_justify="left")
    for column in ("WORKER", "STATE", "IN FLIGHT", "RUNNING", "WAITING"):
        table.add_column(column)
    for w in doc["workers"]:
        table.add_row(w["name"], w["state"], str(w["in_flight"]), str(w["running"]),
                      str(w["waiting"]))
    return table
