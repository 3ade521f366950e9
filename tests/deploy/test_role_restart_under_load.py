"""The lumend role's Restart lumend handler (ansible/roles/lumend/handlers/main.yml: drain ->
stop -> start -> undrain), run by a real ansible-playbook on a node of a live two-node local
cluster while clients stream completions, as an operator's config change sets it off.

The play imports the role (its defaults and handlers; the tasks file it imports,
undrain.yml, does nothing before a drain) and a task that changes something notifies
"Restart lumend": the role's own handlers run, in their order, the restart step included
(no stand-in here). The play gathers no facts and sets ansible_service_mgr to "none", so the
handler takes its plain-process steps, as on a host without systemd as PID 1 (stop_plain.yml:
start-stop-daemon --stop, SIGTERM, on lumend_pid_file; start_plain.yml: start-stop-daemon
--start of lumend_venv/bin/lumend on the same config, logging to the same file); the pid
file names the node's lumend as LocalCluster started it. lumend does not re-adopt its
engines across the restart (the engine reloads); the drain is what keeps the streams. Both
lumends run with [gateway] drain_s = 0 (restarted by hand first: drain_s is read at start),
so the graceful stop waits for no stream.

The load: long streams through the other node's gateway, and streams through a load
balancer in front of both gateways that sends each new stream to the restarted node's
gateway while its /ready answers 200 (else to the other; a 503 at admission, the drain
landing between the check and the request, is retried on the other, as a load balancer
does). Asserted: no stream cut (an error, a broken connection, or text other than the
failure-free stream's), no upstream of the restarted node broke (its streams moved by
migration), the restart happened with streams in flight (a new pid, its engine started
again), and the node serves again after. Negative control: the same play with
lumend_drain_before_restart false, on the other node, breaks upstreams (resumed streams
counted by the gateway), so the checks above can fail.

Both restarted nodes are LocalCluster's children, reaped by a thread here: a stopped
process nobody reaps stays a zombie, which start-stop-daemon --stop takes for alive (and
the PID 1 of some containers reaps nothing)."""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import aiohttp
import pytest
import yaml

from lumenctl.localcluster import LocalCluster, LumendNode
from lumenctl.recovery import read_view
from tests.integration.test_coordinator import all_serving, metric
from tests.integration.test_drain import Streams, busy, expected, ready
from tests.integration.test_graceful_stop import set_drain_s
from tests.integration.test_rolling_restart import broken, engine_starts
from tests.streamread import read_stream

from .conftest import wait_until
from .test_ansible import ansible_env, stop_marked, stop_pid_file
from .test_role_drain import BIN, events, intents

ROLES = Path(__file__).parents[2] / "ansible" / "roles"
MODEL = "sim-small"

pytestmark = pytest.mark.skipif(
    not (BIN / "ansible-playbook").exists() or shutil.which("start-stop-daemon") is None,
    reason="needs ansible-core (the dev extra) and start-stop-daemon")

Result = tuple[set[str], str, list[str]]


def pid_file(tmp_path: Path, node: LumendNode) -> Path:
    return tmp_path / f"{node.name}.pid"


def restart_play(cluster: LocalCluster, node: LumendNode, tmp_path: Path, **extra: object
                 ) -> tuple[int, str]:
    """ansible-playbook: a changed task notifies the role's Restart lumend handler for
    `node`. Returns (exit code, output)."""
    config = tomllib.loads(node.config_path.read_text())
    user = pwd.getpwuid(os.getuid()).pw_name
    playbook = [{
        "hosts": "localhost", "connection": "local", "gather_facts": False,
        "vars": {
            "ansible_python_interpreter": sys.executable,
            "ansible_service_mgr": "none",  # not systemd: the handler's plain-process steps
            "lumend_venv": sys.prefix, "lumend_user": user,
            "lumend_config_file": str(node.config_path), "lumend_node_name": node.name,
            "lumend_metrics_listen": config["metrics"]["listen"],
            "lumend_pid_file": str(pid_file(tmp_path, node)),
            "lumend_log_file": str(node.log_path),
            "lumend_drain_timeout": 90,
            "lumend_drain_required": True,  # a drain that fails stops the play: no restart
            "lumend_gateway_drain_s": config["gateway"].get("drain_s", 30),
            **extra},
        "tasks": [
            # The role's defaults and handlers; undrain.yml runs nothing before a drain.
            {"name": "The lumend role",
             "ansible.builtin.import_role": {"name": "lumend", "tasks_from": "undrain.yml"}},
            {"name": "A change that restarts lumend (config, certificate, wheel)",
             "ansible.builtin.command": {"argv": ["true"]},
             "changed_when": True, "notify": "Restart lumend"},
        ],
    }]
    path = tmp_path / f"restart-{node.name}.yml"
    path.write_text(yaml.safe_dump(playbook, sort_keys=False))
    env = {**ansible_env(), "ANSIBLE_ROLES_PATH": str(ROLES), "ANSIBLE_LOCALHOST_WARNING": "0",
           "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0"}
    done = subprocess.run([str(BIN / "ansible-playbook"), "-i", "localhost,", str(path)],
                          capture_output=True, text=True, env=env, timeout=300)
    return done.returncode, done.stdout + done.stderr


def reaped(tmp_path: Path, node: LumendNode, on_exit: list[int]) -> threading.Thread:
    """Writes the node's pid file (as start-stop-daemon would have) and reaps the process
    when the handler stops it (an entry in `on_exit`)."""
    assert node.proc is not None
    pid_file(tmp_path, node).write_text(f"{node.pid}\n")
    proc = node.proc

    def wait() -> None:
        proc.wait()
        on_exit.append(0)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


async def is_ready(session: aiohttp.ClientSession, base: str) -> bool:
    try:
        async with session.get(base + "/ready", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def balanced(session: aiohttp.ClientSession, victim: str, other: str, prompt: str,
                   max_tokens: int, routed: list[str]) -> Result:
    """One streamed completion through a load balancer in front of `victim` and `other`:
    `victim` while its /ready answers 200, and a 503 at admission retried on `other`. An
    error, a broken connection or a status other than 200 raises (a cut stream)."""
    bases = [victim, other] if await is_ready(session, victim) else [other]
    for base in bases:
        async with session.post(base + "/v1/completions",
                                json={"prompt": prompt, "max_tokens": max_tokens,
                                      "stream": True}) as r:
            if r.status == 503 and base == victim:
                continue
            assert r.status == 200, f"{base}: {r.status} {await r.text()}"
            routed.append(base)
            return await read_stream(r)
    raise AssertionError("unreachable: the other gateway answers or raises")


def uncut(results: list[Result | BaseException], prompts: list[str], max_tokens: int
          ) -> list[str]:
    """What went wrong with each stream that did not equal its failure-free stream."""
    bad = []
    for prompt, result in zip(prompts, results, strict=True):
        if isinstance(result, BaseException):
            bad.append(f"{prompt}: {result!r}")
            continue
        ids, text, errors = result
        if errors or len(ids) != 1 or text != expected(prompt, False, max_tokens):
            bad.append(f"{prompt}: errors {errors}, {len(ids)} ids, text differs: "
                       f"{text != expected(prompt, False, max_tokens)}")
    return bad


def serves(cluster: LocalCluster, node: LumendNode, pid: int) -> bool:
    view = read_view(cluster.endpoints, cluster.cluster)
    me = view.nodes.get(node.name)
    return me is not None and me.pid == pid and all(
        w.state == "serving" for w in view.workers.values() if w.node == node.name)


def both_serving(cluster: LocalCluster) -> bool:
    """Both workers serving and a coordinator elected (all_serving asks LocalCluster which
    nodes run, and the restarted lumend is not its process)."""
    view = read_view(cluster.endpoints, cluster.cluster)
    return view.coordinator is not None and sorted(
        w.name for w in view.workers.values() if w.state == "serving") == [
        "node-1-w0", "node-2-w0"]


def test_the_restart_handler_under_streaming_load(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster", size=2, lease_ttl_s=3, shadows=0,
                           cluster="rolerestart", engine_args=("--time-scale", "3.0")).start()
    victim, client = cluster.node("node-1"), cluster.node("node-2")
    try:
        # The graceful stop waits for no stream (drain_s = 0, read at start: both lumends
        # start again with it): what keeps the streams is the drain, and without it (the
        # control) they break.
        for node in (victim, client):
            set_drain_s(node, 0)
            node.stop()
            node.start()
        wait_until(all_serving(cluster), 90, "both workers serving")
        stopped: list[int] = []
        reaped(tmp_path, victim, stopped)
        reaped(tmp_path, client, stopped)

        async def scenario() -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
                await ready(cluster, s, client.gateway)
                # Through the other node's gateway, long enough to outlast the play.
                long = Streams(s, client.gateway, "role restart, stream {}", 6, 1500)
                # Through the load balancer, a new one every half second until the play ends.
                routed: list[str] = []
                prompts: list[str] = []
                tasks: list[asyncio.Task[Result]] = []
                done = asyncio.Event()

                async def balancer() -> None:
                    while not done.is_set():
                        prompts.append(f"balanced stream {len(prompts)}")
                        tasks.append(asyncio.create_task(balanced(
                            s, victim.gateway, client.gateway, prompts[-1], 200, routed)))
                        await asyncio.sleep(0.5)

                lb = asyncio.create_task(balancer())
                await long.going(pieces=20)
                await asyncio.to_thread(wait_until, lambda: busy(cluster, "node-1-w0"), 20,
                                        "streams on node-1-w0 (the restart would cut none)")
                async def through_victim() -> None:
                    while victim.gateway not in routed:
                        await asyncio.sleep(0.1)

                await asyncio.wait_for(through_victim(), 30)  # its /ready answers 200
                before, moved = broken(client), metric(client, "lumen_gateway_migrations_total")
                starts, old_pid = engine_starts(victim), victim.pid
                code, out = await asyncio.to_thread(restart_play, cluster, victim, tmp_path)
                done.set()
                await lb
                assert code == 0, out
                assert stopped, "the handler did not stop lumend"
                assert min(r[0] for r in long.received) < long.max_tokens, (
                    "the long streams ended before the restart: the test is void")
                new_pid = int(pid_file(tmp_path, victim).read_text())
                assert new_pid != old_pid
                await asyncio.to_thread(wait_until, lambda: serves(cluster, victim, new_pid),
                                        90, "node-1 serving again under its new lumend")

                await long.check_against_failure_free()
                results = await asyncio.gather(*tasks, return_exceptions=True)
                assert uncut(results, prompts, 200) == []
                assert client.gateway in routed[routed.index(victim.gateway):], (
                    "the load balancer never moved to the other gateway")
                assert broken(client) == before, "an upstream broke under the handler's drain"
                assert "stream from node-1-w0 broke" not in client.log_text()
                assert "stream from node-1-w0 broke" not in victim.log_text()
                assert metric(client, "lumen_gateway_migrations_total") > moved
                # The drain keeps the streams, not the engines: the restart reloaded them.
                assert engine_starts(victim) == starts + 1
                kinds = [(e["kind"], e["message"])
                         for e in await asyncio.to_thread(events, cluster)]
                assert any(k == "drain_requested" and "ansible: restart of lumend" in m
                           for k, m in kinds), kinds
                assert any(k == "drain_withdrawn" and "node-1" in m for k, m in kinds), kinds
                assert await asyncio.to_thread(intents, cluster) == []
                # It serves: ready for the load balancer, and a completion through it.
                await asyncio.to_thread(wait_until, lambda: both_serving(cluster), 60,
                                        "both serving")
                assert await is_ready(s, victim.gateway)
                results = [await balanced(s, victim.gateway, client.gateway, "after", 8, [])]
                assert uncut(list(results), ["after"], 8) == []

                # Negative control: the same handler without the drain, on node-2, streams
                # through node-1's gateway.
                await ready(cluster, s, victim.gateway)
                control = Streams(s, victim.gateway, "role restart, no drain, stream {}", 6,
                                  1500)
                await control.going(pieces=20)
                await asyncio.to_thread(wait_until, lambda: busy(cluster, "node-2-w0"), 20,
                                        "streams on node-2-w0 (the control would be void)")
                before = broken(victim)
                code, out = await asyncio.to_thread(restart_play, cluster, client, tmp_path,
                                                    lumend_drain_before_restart=False)
                assert code == 0, out
                await asyncio.to_thread(wait_until, lambda: both_serving(cluster), 90,
                                        "both serving")
                await asyncio.gather(*control.tasks, return_exceptions=True)
                assert broken(victim) > before, (
                    "a restart without the drain broke no upstream: the checks are void")
                assert "stream from node-2-w0 broke" in victim.log_text()

        asyncio.run(scenario())
    finally:
        for node in cluster.nodes:
            stop_pid_file(pid_file(tmp_path, node))
        stop_marked()
        cluster.stop()
