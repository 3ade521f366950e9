"""ansible/: syntax check, ansible-lint's production profile, and a real run of deploy.yml
against three hosts on this machine (local connection, one prefix and port set each).

LUMEN reaches the hosts as an operator's run would bring it: the wheel built from this
checkout, copied to each host and installed from the file into a virtualenv of the test's
own, with pip told to use no index at all (so no name is looked up anywhere). The test's
virtualenv sees this checkout's dependencies through a .pth line, so nothing is downloaded.
The gRPC control plane runs with the mTLS certificates the role makes.

Where systemd is not PID 1 (here) the roles start etcd and lumend as plain processes with
start-stop-daemon and pid files; the fixture stops them by those pids. Every process the
plays start carries this run's mark in its environment (`RUN_MARK`): whatever a play that
failed midway left behind (a daemon whose pid file was never written or was removed, an
engine whose lumend was SIGKILLed) is found by the mark and stopped by its pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

from lumenctl.demo import read_view
from lumenctl.localcluster import free_ports
from lumenctl.localcluster import process_running as alive  # zombies count as gone
from lumend.checkpoint.security import CurveKeys

REPO = Path(__file__).parents[2]
ANSIBLE = REPO / "ansible"
BIN = Path(sys.executable).parent
HOSTS = ("lumen-a", "lumen-b", "lumen-c")
SITE_PACKAGES = next(Path(p) for p in sys.path if p.endswith("site-packages")
                     and p.startswith(sys.prefix))

pytestmark = pytest.mark.skipif(
    not (BIN / "ansible-playbook").exists() or shutil.which("start-stop-daemon") is None,
    reason="needs ansible-core in the venv (pip install -e '.[dev]') and start-stop-daemon",
)


def ansible_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["ANSIBLE_NOCOLOR"] = "1"
    env["ANSIBLE_FORCE_COLOR"] = "0"
    env["ANSIBLE_HOST_KEY_CHECKING"] = "0"
    env["ANSIBLE_RETRY_FILES_ENABLED"] = "0"
    env["ANSIBLE_FORKS"] = "3"
    env[RUN_MARK[0]] = RUN_MARK[1]
    return env


# In the environment of everything the plays start (ansible, start-stop-daemon, etcd,
# lumend, its engines all inherit it): how a finalizer finds what a run left behind.
RUN_MARK = ("LUMEN_ANSIBLE_TEST_RUN", f"{os.getpid()}-{time.time_ns()}")


def marked(mark: tuple[str, str] = RUN_MARK) -> list[int]:
    """The pids of live processes whose environment carries `mark` (NAME, VALUE)."""
    wanted = f"{mark[0]}={mark[1]}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if wanted in environ.split(b"\0") and alive(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)


def stop_marked(mark: tuple[str, str] = RUN_MARK, grace_s: float = 15.0) -> list[int]:
    """SIGTERM every process carrying `mark`, SIGKILL those left after `grace_s`; returns
    the pids it signalled."""
    pids = marked(mark)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    for pid in marked(mark):  # the lingering, and any started while the others stopped
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def run(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, env=ansible_env(),
                          timeout=600, **kwargs)


def test_syntax_check() -> None:
    result = run([str(BIN / "ansible-playbook"), "-i", str(ANSIBLE / "inventory.example.yml"),
                  str(ANSIBLE / "deploy.yml"), "--syntax-check"])
    assert result.returncode == 0, result.stdout + result.stderr


def lint(directory: Path) -> subprocess.CompletedProcess[str]:
    return run([str(BIN / "ansible-lint"), "--offline", "--nocolor", "--profile", "production",
                str(directory)], cwd=directory.parent)


def test_ansible_lint_production_profile(tmp_path: Path) -> None:
    result = lint(ANSIBLE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 failure(s), 0 warning(s)" in result.stdout + result.stderr

    # Negative control: a role variable without the role's prefix fails the profile.
    copy = tmp_path / "ansible"
    shutil.copytree(ANSIBLE, copy)
    defaults = copy / "roles" / "lumend" / "defaults" / "main.yml"
    defaults.write_text(defaults.read_text() + "ready_retries: 3\n")
    broken = lint(copy)
    assert broken.returncode != 0
    assert "var-naming[no-role-prefix]" in broken.stdout + broken.stderr


def render_role_defaults(role: str) -> dict[str, Any]:
    """The role's defaults, with references between them resolved (as Ansible would)."""
    values: dict[str, Any] = yaml.safe_load((ANSIBLE / "roles" / role / "defaults" /
                                             "main.yml").read_text())
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    for _ in range(5):
        for key, value in values.items():
            if isinstance(value, str) and "{{" in value:
                # Some need facts or hostvars; the unit uses none of those.
                with contextlib.suppress(jinja2.UndefinedError):
                    values[key] = env.from_string(value).render(values)
    return values


def test_unit_template_renders_to_the_shipped_unit() -> None:
    template = (ANSIBLE / "roles" / "lumend" / "templates" / "lumend.service.j2").read_text()
    rendered = jinja2.Environment(keep_trailing_newline=True).from_string(template).render(
        render_role_defaults("lumend"))
    assert rendered == (REPO / "systemd" / "lumend.service").read_text()


def test_the_example_inventory_renders_configs_whose_engines_fit(tmp_path: Path) -> None:
    """Every host of inventory.example.yml renders (lumend.toml.j2) to a config lumend
    accepts, each GPU worker with shadows has a memory split, and the split fits the
    80 GB GPUs the inventory says it is sized for with the models' bf16 weights."""
    from lumend.config import memory_split_warnings, parse_config

    inventory = yaml.safe_load((ANSIBLE / "inventory.example.yml").read_text())["all"]
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(
        ANSIBLE / "roles" / "lumend" / "templates"), keep_trailing_newline=True,
        trim_blocks=True)  # as Ansible's template module
    env.filters["to_json"] = json.dumps
    weights = {"/models/Qwen3-32B": 61 * 1024**3, "/models/Qwen3-8B": 15 * 1024**3}
    gpu = 81559 * 1024**2  # an 80 GB GPU as nvidia-smi reports it (MiB)
    hosts = inventory["children"]["lumen"]["hosts"]
    for host, host_vars in hosts.items():
        variables = {**render_role_defaults("lumend"), **inventory["vars"], **host_vars,
                     "lumend_node_name": host,
                     "lumend_etcd_endpoints": ["http://10.0.0.1:2379"],
                     "lumend_etcd_tls": False, "lumend_checkpoint_insecure": True,
                     "lumend_rpc_insecure": True}
        config = parse_config(env.get_template("lumend.toml.j2").render(**variables))
        assert config.workers, host
        for worker in config.workers:
            assert worker.kv_cache_bytes, (host, worker.name)
            assert memory_split_warnings(worker, gpu, weights[worker.model]) == [], host
    # Control: twice the KV cache of gpu-node-1's workers does not fit.
    worker = parse_config(env.get_template("lumend.toml.j2").render(
        **{**render_role_defaults("lumend"), **inventory["vars"], **hosts["gpu-node-1"],
           "lumend_node_name": "gpu-node-1", "lumend_etcd_endpoints": ["http://a:2379"],
           "lumend_etcd_tls": False, "lumend_checkpoint_insecure": True,
           "lumend_rpc_insecure": True}).replace('"16GiB"', '"32GiB"')).workers[0]
    assert memory_split_warnings(worker, gpu, weights[worker.model])
    # lumend_gateway_log_admissions: off by default, on when the inventory asks.
    base = {**render_role_defaults("lumend"), **inventory["vars"], **hosts["gpu-node-1"],
            "lumend_node_name": "gpu-node-1", "lumend_etcd_endpoints": ["http://a:2379"],
            "lumend_etcd_tls": False, "lumend_checkpoint_insecure": True,
            "lumend_rpc_insecure": True}
    for asked in (False, True):
        rendered = env.get_template("lumend.toml.j2").render(
            **{**base, "lumend_gateway_log_admissions": asked})
        assert parse_config(rendered).gateway.log_admissions is asked


# -- the real run ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from the checkout as it is (tracked and new files), in a copy."""
    root = tmp_path_factory.mktemp("wheel")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (root / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / "src" / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                            "--no-build-isolation", "--no-index", "-w", str(root / "dist"),
                            str(root / "src")], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    [found] = (root / "dist").glob("lumen_serving-*.whl")
    return found


@pytest.fixture(scope="module")
def node_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty virtualenv for the hosts; this checkout's dependencies visible to it through
    a .pth line (not LUMEN itself: .pth files of that directory are not processed, so the
    checkout's editable install stays out of it)."""
    venv = tmp_path_factory.mktemp("node-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    [site] = venv.glob("lib/python3*/site-packages")
    (site / "lumen-test-deps.pth").write_text(f"{SITE_PACKAGES}\n")
    return venv


def apt_task_changes_nothing(extras: list[str]) -> bool:
    """Whether the lumend role's apt task (tasks/install.yml) may run on this machine and
    report ok without changing it, so the test exercises its package names: as root (uid 0),
    with every package it names installed (lumend_system_packages, plus
    lumend_system_packages_systemd with the systemd extra; scripts/system-deps.sh does not
    install python3-venv, gcc or python3-dev, so an image may lack them), python3-apt for the
    module itself (else the module installs it). The task installs from the package lists the
    node has and refreshes them only when that fails, so then it runs no apt-get update.
    Anywhere else the test sets lumend_install_system_packages false and the task is
    skipped."""
    if os.geteuid() != 0 or shutil.which("dpkg-query") is None:
        return False
    defaults = render_role_defaults("lumend")
    packages = [*defaults["lumend_system_packages"], "python3-apt",
                *(defaults["lumend_system_packages_systemd"] if "systemd" in extras else [])]
    status = subprocess.run(["dpkg-query", "-W", "-f=${Status}\n", *packages],
                            capture_output=True, text=True, timeout=30)
    lines = status.stdout.splitlines()
    return status.returncode == 0 and lines == ["install ok installed"] * len(packages)


def host_vars(name: str, prefix: Path, ports: list[int], user: str, wheel: Path,
              venv: Path) -> dict[str, Any]:
    client, peer, gateway, rpc, checkpoint, metrics, engine = ports
    return {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_become": False,
        "etcd_address": "127.0.0.1",
        "etcd_tls": False,  # plaintext here; TLS in test_deploy_with_tls_and_a_member_added
        "etcd_client_port": client,
        "etcd_peer_port": peer,
        "etcd_cluster_token": f"lumen-ansible-test-{os.getpid()}",
        "etcd_data_dir": str(prefix / "var/lib/etcd"),
        "etcd_default_file": str(prefix / "etc/default/etcd"),
        "etcd_user": user,
        "etcd_pid_file": str(prefix / "run/etcd.pid"),
        "etcd_log_file": str(prefix / "log/etcd.log"),
        "etcd_health_retries": 30,
        "lumend_create_user": False,
        "lumend_user": user,
        "lumend_group": user,
        "lumend_venv": str(venv),
        "lumend_wheel": str(wheel),
        "lumend_wheel_dir": str(prefix / "opt/lumen/wheels"),
        "lumend_pip_extra_args": "--no-index",  # no name is looked up in any index
        # The role's apt task runs only where it can change nothing: see the function.
        "lumend_install_system_packages": apt_task_changes_nothing(extras=[]),
        "lumend_extras": [],  # systemd-python comes with the .pth of node_venv
        "lumend_config_dir": str(prefix / "etc/lumen"),
        "lumend_node_name": name,
        "lumend_address": "127.0.0.1",
        "lumend_cluster": "ansible-test",
        "lumend_etcd_lease_ttl_s": 3,
        "lumend_etcd_request_timeout_s": 1.0,
        "lumend_gateway_listen": f"127.0.0.1:{gateway}",
        "lumend_rpc_listen": f"127.0.0.1:{rpc}",
        "lumend_checkpoint_listen": f"127.0.0.1:{checkpoint}",
        "lumend_checkpoint_budget": "1GiB",
        "lumend_metrics_listen": f"127.0.0.1:{metrics}",
        "lumend_state_dir": str(prefix / "var/lib/lumen"),
        "lumend_runtime_dir": str(prefix / "run/lumen"),
        "lumend_workers": [{"name": f"{name}-w0", "gpus": [0], "engine": "sim",
                            "model": "sim-small", "port": engine}],
        "lumend_logrotate_dir": str(prefix / "etc/logrotate.d"),
        "lumend_pid_file": str(prefix / "run/lumend.pid"),
        "lumend_log_file": str(prefix / "log/lumend.log"),
        "lumend_ready_retries": 60,
        "lumend_ready_delay": 1,
    }


def stop_pid_file(path: Path) -> None:
    """SIGTERM the process a pid file names, wait, SIGKILL if it lingers."""
    if not path.exists() or not path.read_text().strip().isdigit():  # a half-written one
        return
    pid = int(path.read_text().strip())
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if not alive(pid):
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def test_hosts(tmp_path: Path, wheel: Path, node_venv: Path,
               request: pytest.FixtureRequest) -> Iterator[dict[str, dict[str, Any]]]:
    # After the pid files' stops below: whatever the plays started that is still running.
    request.addfinalizer(stop_marked)
    user = pwd.getpwuid(os.getuid()).pw_name
    ports = free_ports(7 * len(HOSTS))
    hosts = {}
    for i, name in enumerate(HOSTS):
        prefix = tmp_path / name
        for sub in ("etc/default", "etc/logrotate.d", "run", "log"):
            (prefix / sub).mkdir(parents=True)
        hosts[name] = host_vars(name, prefix, ports[7 * i: 7 * i + 7], user, wheel,
                                node_venv)
    try:
        yield hosts
    finally:
        for variables in hosts.values():
            stop_pid_file(Path(variables["lumend_pid_file"]))
        for variables in hosts.values():
            stop_pid_file(Path(variables["etcd_pid_file"]))


def test_what_a_play_started_is_found_by_its_mark_and_stopped_by_pid(
        tmp_path: Path) -> None:
    """The fixtures' finalizer: a daemon a play started as the roles do (start-stop-daemon,
    detached, not our child) carries the run's mark and is stopped by its pid, its pid file
    lost or not; a process without the mark (the control) is neither found nor stopped."""
    pid_file = tmp_path / "daemon.pid"
    playbook = tmp_path / "start.yml"
    playbook.write_text(yaml.safe_dump([{
        "hosts": "localhost", "gather_facts": False, "tasks": [{
            "name": "Start a daemon", "ansible.builtin.command": {"argv": [
                "start-stop-daemon", "--start", "--background", "--make-pidfile", "--pidfile",
                str(pid_file), "--startas", "/bin/sleep", "--", "300"]}}]}]))
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        started = run([str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                       str(playbook), "-e", json.dumps({"ansible_python_interpreter":
                                                        sys.executable})])
        assert started.returncode == 0, started.stdout + started.stderr
        daemon = int(pid_file.read_text())
        pid_file.unlink()  # as a play that failed between a stop and a start leaves it
        assert daemon in marked() and other.pid not in marked()
        assert daemon in stop_marked()
        assert not alive(daemon)
        assert other.poll() is None
        assert marked() == []
    finally:
        other.kill()
        other.wait()


def recap(output: str) -> dict[str, dict[str, int]]:
    found = {}
    for line in output.split("PLAY RECAP", 1)[-1].splitlines():
        match = re.match(r"(\S+)\s+:\s+(.*)", line.strip())
        if match:
            found[match.group(1)] = {k: int(v) for k, v in
                                     re.findall(r"(\w+)=(\d+)", match.group(2))}
    return found


@pytest.mark.timeout(1500)  # three runs of the play, each installing and checking 3 hosts
# (6-7 min alone on 2 cores; a loaded machine took it past 900 s)
def test_deploy_forms_a_cluster_and_is_idempotent(
    tmp_path: Path, test_hosts: dict[str, dict[str, Any]]
) -> None:
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {
        "etcd": {"hosts": test_hosts},
        "lumen": {"hosts": {name: {} for name in test_hosts}},
    }}}))
    playbook = [str(BIN / "ansible-playbook"), "-i", str(inventory), str(ANSIBLE / "deploy.yml")]

    first = run(playbook)
    output = first.stdout + first.stderr
    assert first.returncode == 0, output[-6000:]
    assert all(r["failed"] == 0 and r["unreachable"] == 0 for r in recap(output).values())

    # The rendered etcd settings formed one 3-member cluster.
    endpoints = [f"http://127.0.0.1:{v['etcd_client_port']}" for v in test_hosts.values()]
    for endpoint in endpoints:  # etcd's v3 JSON gateway: each member sees all three
        request = urllib.request.Request(f"{endpoint}/v3/cluster/member/list", data=b"{}",
                                         method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            members = json.loads(response.read())["members"]
        assert sorted(m["name"] for m in members) == list(HOSTS)
        # The role's compaction and quota settings reached the running member.
        with urllib.request.urlopen(f"{endpoint}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert "\netcd_server_quota_backend_bytes 4.294967296e+09" in metrics
    for variables in test_hosts.values():
        settings = Path(variables["etcd_default_file"]).read_text()
        assert 'ETCD_AUTO_COMPACTION_MODE="periodic"' in settings
        assert 'ETCD_AUTO_COMPACTION_RETENTION="1h"' in settings

    # The rendered lumend configs pass check-config, and the three nodes registered.
    for variables in test_hosts.values():
        config = Path(variables["lumend_config_dir"]) / "lumend.toml"
        check = subprocess.run([str(BIN / "lumend"), "check-config", str(config)],
                               capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr

    # One CURVE key file, made once on the controller, landed on every node private to the
    # lumend user; each config names it and each holder runs with it.
    cluster_keys = CurveKeys.load(tmp_path / "lumen-ansible-test-checkpoint.keys")
    for variables in test_hosts.values():
        keys = Path(variables["lumend_config_dir"]) / "checkpoint.keys"
        assert stat.S_IMODE(keys.stat().st_mode) == 0o600
        assert keys.stat().st_uid == pwd.getpwnam(variables["lumend_user"]).pw_uid
        assert CurveKeys.load(keys) == cluster_keys
        config = Path(variables["lumend_config_dir"]) / "lumend.toml"
        assert f"keys = {json.dumps(str(keys))}" in config.read_text()
        assert "CURVE (cluster keys)" in Path(variables["lumend_log_file"]).read_text()
    # LUMEN runs from the wheel installed into the hosts' virtualenv, not from the checkout.
    venv = Path(test_hosts["lumen-a"]["lumend_venv"])
    where = subprocess.run([str(venv / "bin/python"), "-c",
                            "import lumend; print(lumend.__file__)"],
                           capture_output=True, text=True, timeout=30, cwd="/")
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    # gRPC with mTLS by default: certificates made once on the controller, private to the
    # lumend user on each node, named in [rpc], and the servers run with them.
    pki = tmp_path / "lumen-rpc-pki"
    assert (pki / "ca.pem").exists() and (pki / "rpc-admin.pem").exists()
    for variables in test_hosts.values():
        config_dir = Path(variables["lumend_config_dir"])
        for name in ("rpc-ca.pem", "rpc-node.pem", "rpc-node-key.pem"):
            assert stat.S_IMODE((config_dir / name).stat().st_mode) == 0o600, name
        assert f'cert = "{config_dir / "rpc-node.pem"}"' in (config_dir / "lumend.toml").read_text()
        assert ", mTLS" in Path(variables["lumend_log_file"]).read_text()
    # Engine logs rotate; logrotate accepts the file where it is installed.
    rotate = Path(test_hosts["lumen-a"]["lumend_logrotate_dir"]) / "lumen"
    assert f"{test_hosts['lumen-a']['lumend_state_dir']}/logs/*.log {{" in rotate.read_text()
    if shutil.which("logrotate"):
        dry = subprocess.run(["logrotate", "--debug", "--state", str(tmp_path / "lr.state"),
                              str(rotate)], capture_output=True, text=True, timeout=30)
        assert dry.returncode == 0, dry.stdout + dry.stderr
    view = read_view(endpoints, "ansible-test")
    assert sorted(view.nodes) == list(HOSTS)
    assert sorted(view.workers) == [f"{h}-w0" for h in HOSTS]
    assert view.coordinator is not None
    pids = {name: int(Path(v["lumend_pid_file"]).read_text()) for name, v in test_hosts.items()}
    assert {name: view.nodes[name].pid for name in HOSTS} == pids

    second = run(playbook)
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-6000:]
    counts = recap(output)
    assert sorted(counts) == list(HOSTS)
    assert {name: c["changed"] for name, c in counts.items()} == dict.fromkeys(HOSTS, 0), \
        output[-6000:]
    # Nothing was restarted by the second run.
    assert {name: int(Path(v["lumend_pid_file"]).read_text())
            for name, v in test_hosts.items()} == pids

    # Negative control of the rolling wait: a node that does not reach the wanted state
    # fails the play, naming what it saw, and the roll stops at the first node.
    third = run([*playbook, "-e", '{"lumend_ready_worker_states": ["no-such-state"], '
                 '"lumend_ready_retries": 2, "lumend_ready_delay": 1}'])
    output = third.stdout + third.stderr
    assert third.returncode != 0, output[-6000:]
    assert "lumen-a does not serve after 2 s" in output, output[-6000:]
    assert "lumen-a-w0 serving" in output
    assert "TASK [lumend : Stop the roll (this node does not serve)]" in output
    # serial 1: the play's tasks ran for one batch only (lumen-b and lumen-c untouched).
    assert output.count("TASK [lumend : Check how LUMEN is to be installed]") == 1


def test_role_refuses_to_install_without_a_wheel_or_index(tmp_path: Path) -> None:
    """No wheel built (or two), or an index without a URL: the play fails saying what to do,
    before anything is installed."""
    playbook = tmp_path / "install.yml"
    playbook.write_text(yaml.safe_dump([{
        "hosts": "localhost", "gather_facts": False, "tasks": [{
            "name": "Install LUMEN", "ansible.builtin.include_role": {
                "name": str(ANSIBLE / "roles" / "lumend"), "tasks_from": "install.yml"}}]}]))
    base = [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(playbook),
            "-e", json.dumps({"lumend_install_system_packages": False,
                              "lumend_venv": str(tmp_path / "venv")})]
    cases = {
        "build it from the checkout with `make wheel`": {"lumend_wheel": []},
        "more than one LUMEN wheel": {"lumend_wheel": ["/a/lumen_serving-1.whl",
                                                       "/b/lumen_serving-2.whl"]},
        "lumend_index_url is empty": {"lumend_install_from": "index"},
    }
    for message, variables in cases.items():
        result = run([*base, "-e", json.dumps(variables)])
        output = result.stdout + result.stderr
        assert result.returncode != 0, output[-3000:]
        assert message in " ".join(output.split()), output[-3000:]
        assert not (tmp_path / "venv").exists()


# -- etcd over TLS, and a member added to a running cluster ---------------------------------

TLS_HOSTS = ("lumen-a", "lumen-b", "lumen-c", "lumen-d")


@pytest.fixture
def tls_hosts(tmp_path: Path, wheel: Path, node_venv: Path,
              request: pytest.FixtureRequest) -> Iterator[dict[str, dict[str, Any]]]:
    # After the pid files' stops below: whatever the plays started that is still running.
    request.addfinalizer(stop_marked)
    user = pwd.getpwuid(os.getuid()).pw_name
    ports = free_ports(7 * len(TLS_HOSTS))
    hosts = {}
    for i, name in enumerate(TLS_HOSTS):
        prefix = tmp_path / name
        for sub in ("etc/default", "etc/logrotate.d", "run", "log"):
            (prefix / sub).mkdir(parents=True)
        variables = host_vars(name, prefix, ports[7 * i: 7 * i + 7], user, wheel, node_venv)
        variables["etcd_tls"] = True
        variables["etcd_tls_dir"] = str(prefix / "etc/etcd/pki")
        hosts[name] = variables
    try:
        yield hosts
    finally:
        for variables in hosts.values():
            stop_pid_file(Path(variables["lumend_pid_file"]))
        for variables in hosts.values():
            stop_pid_file(Path(variables["etcd_pid_file"]))


def tls_members(endpoint: str, context: ssl.SSLContext) -> list[str]:
    request = urllib.request.Request(f"{endpoint}/v3/cluster/member/list", data=b"{}",
                                     method="POST")
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        return sorted(m["name"] for m in json.loads(response.read())["members"])


def lumenctl_status(config: Path) -> dict[str, Any]:
    result = subprocess.run([str(BIN / "lumenctl"), "--config", str(config), "-o", "json",
                             "status"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    status: dict[str, Any] = json.loads(result.stdout)
    return status


@pytest.mark.timeout(1500)
def test_deploy_with_tls_and_a_member_added(
    tmp_path: Path, tls_hosts: dict[str, dict[str, Any]]
) -> None:
    inventory = tmp_path / "inventory.yml"
    playbook = [str(BIN / "ansible-playbook"), "-i", str(inventory), str(ANSIBLE / "deploy.yml")]

    def deploy(etcd_hosts: tuple[str, ...]) -> dict[str, dict[str, int]]:
        inventory.write_text(yaml.safe_dump({"all": {"children": {
            "etcd": {"hosts": {name: tls_hosts[name] for name in etcd_hosts}},
            "lumen": {"hosts": {"lumen-a": tls_hosts["lumen-a"]}},
        }}}))
        result = run(playbook)
        output = result.stdout + result.stderr
        log = tmp_path / f"deploy-{len(list(tmp_path.glob('deploy-*.log')))}.log"
        log.write_text(output)
        assert result.returncode == 0, f"see {log}\n" + output[-6000:]
        counts = recap(output)
        assert all(c["failed"] == 0 and c["unreachable"] == 0 for c in counts.values()), log
        return counts

    def etcd_pids() -> dict[str, int]:
        return {name: int(Path(v["etcd_pid_file"]).read_text()) for name, v in tls_hosts.items()
                if Path(v["etcd_pid_file"]).exists()}

    def settings(name: str) -> str:
        return Path(tls_hosts[name]["etcd_default_file"]).read_text()

    deploy(TLS_HOSTS[:3])

    # The CA made once on the controller; every member serves https with its certificate
    # and requires a client certificate signed by the CA.
    pki = tmp_path / "lumen-etcd-pki"
    admin = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    admin.load_cert_chain(pki / "client-admin.pem", pki / "client-admin-key.pem")
    endpoints = {name: f"https://127.0.0.1:{v['etcd_client_port']}"
                 for name, v in tls_hosts.items()}
    for name in TLS_HOSTS[:3]:
        assert tls_members(endpoints[name], admin) == list(TLS_HOSTS[:3])
        assert "ETCD_CLIENT_CERT_AUTH=\"true\"" in settings(name)
        for file in Path(tls_hosts[name]["etcd_tls_dir"]).iterdir():
            assert stat.S_IMODE(file.stat().st_mode) == 0o600, file
    no_cert = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        tls_members(endpoints["lumen-a"], no_cert)

    # lumend got its client certificate (0600, its user) and registered through TLS.
    config_dir = Path(tls_hosts["lumen-a"]["lumend_config_dir"])
    config = config_dir / "lumend.toml"
    assert "https://" in config.read_text()
    assert f'cert = "{config_dir / "etcd-client.pem"}"' in config.read_text()
    for name in ("etcd-ca.pem", "etcd-client.pem", "etcd-client-key.pem"):
        assert stat.S_IMODE((config_dir / name).stat().st_mode) == 0o600
    assert [n["name"] for n in lumenctl_status(config)["nodes"]] == ["lumen-a"]

    # A fourth host in the `etcd` group joins the running cluster; the others keep running
    # with their settings untouched.
    before = {name: settings(name) for name in TLS_HOSTS[:3]}
    pids = etcd_pids()
    deploy(TLS_HOSTS)
    for name in TLS_HOSTS:
        assert tls_members(endpoints[name], admin) == list(TLS_HOSTS)
    assert {name: settings(name) for name in TLS_HOSTS[:3]} == before
    assert {name: etcd_pids()[name] for name in TLS_HOSTS[:3]} == pids
    joined = settings("lumen-d")
    assert 'ETCD_INITIAL_CLUSTER_STATE="existing"' in joined
    cluster = re.search(r'^ETCD_INITIAL_CLUSTER="([^"]*)"$', joined, re.M)
    assert cluster is not None
    assert sorted(entry.split("=")[0] for entry in cluster.group(1).split(",")) == \
        list(TLS_HOSTS)
    # lumend now knows all four endpoints (a rolling restart) and is registered again.
    assert endpoints["lumen-d"] in config.read_text()
    assert [n["name"] for n in lumenctl_status(config)["nodes"]] == ["lumen-a"]

    # Idempotent: nothing changes on a third run, nothing restarts.
    pids = etcd_pids()
    lumend_pid = Path(tls_hosts["lumen-a"]["lumend_pid_file"]).read_text()
    counts = deploy(TLS_HOSTS)
    assert sorted(counts) == list(TLS_HOSTS)
    assert {name: c["changed"] for name, c in counts.items()} == dict.fromkeys(TLS_HOSTS, 0)
    assert etcd_pids() == pids
    assert Path(tls_hosts["lumen-a"]["lumend_pid_file"]).read_text() == lumend_pid
