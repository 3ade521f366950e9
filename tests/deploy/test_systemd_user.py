"""systemd/lumend.service under a real systemd: a user manager (`systemd --user`) in a private
mount namespace, because systemd is not PID 1 here.

systemd refuses to run a user manager unless /run/systemd/system exists ("the system has not
been booted with systemd"); creating it on the host would make every tool on the machine
(Ansible's service-manager fact included) believe systemd is PID 1. So the manager runs
under `unshare -m` with a tmpfs over /run/systemd, and systemctl joins that namespace with
`nsenter`. It also starts in cgroups of its own: a manager moves every process of the
cgroup it starts in into its init.scope, which from the root cgroup would be the whole
machine (the fixture checks that PID 1's cgroups did not change). This needs root
(CAP_SYS_ADMIN for the mount, cgroup writes); the test skips otherwise.

The unit is the shipped file; a drop-in changes only what a test host needs: the venv and
config paths, no User= (a user manager runs services as its own user), /tmp visible (the
test's files live there, which PrivateTmp= would hide), and home directories read-only
rather than hidden when this venv's Python lives in one (pyenv under /root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lumenctl.localcluster import EtcdCluster, free_ports, node_config_toml

from .conftest import read_view, wait_until

REPO = Path(__file__).parents[2]
UNIT = REPO / "systemd" / "lumend.service"
SYSTEMD = Path("/usr/lib/systemd/systemd")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not SYSTEMD.exists() or shutil.which("unshare") is None
    or shutil.which("nsenter") is None,
    reason="needs root, systemd, unshare and nsenter (a user manager in a mount namespace)",
)


class UserManager:
    """`systemd --user` in its own mount namespace; `systemctl` runs inside it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(root / "home"),
            "XDG_RUNTIME_DIR": str(root / "run"),
            "XDG_CONFIG_HOME": str(root / "config"),
            "XDG_STATE_HOME": str(root / "state"),
            "XDG_CACHE_HOME": str(root / "cache"),
            "XDG_DATA_HOME": str(root / "data"),
        }
        for path in list(self.env.values())[1:]:
            Path(path).mkdir(parents=True, exist_ok=True, mode=0o700)
        self.units = root / "config" / "systemd" / "user"
        self.units.mkdir(parents=True)
        self.log = root / "systemd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        name = f"lumen-test-{os.getpid()}-{time.monotonic_ns()}"
        self.cgroups = [h / name for h in cgroup_hierarchies()]

    def start(self) -> UserManager:
        # A manager takes the cgroup it starts in as its own and moves every process in it
        # into init.scope: started in the root cgroup it would take in the whole machine, so
        # it starts in a cgroup of its own in each hierarchy (as under user@.service).
        # Running as root, it takes the nodes it mounts over hidden paths (ProtectHome= and
        # the like) from /run/systemd/inaccessible, which PID 1 would have made; this one
        # makes them under $XDG_RUNTIME_DIR.
        cgroups = " ".join(str(d) for d in self.cgroups)
        script = (f'for d in {cgroups}; do mkdir "$d" && echo $$ > "$d/cgroup.procs" || '
                  "exit 1; done && "
                  "mount -t tmpfs tmpfs /run/systemd && mkdir /run/systemd/system && "
                  'ln -s "$XDG_RUNTIME_DIR/systemd/inaccessible" /run/systemd/inaccessible && '
                  f"exec {SYSTEMD} --user")
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: self.systemctl("is-system-running").stdout.strip()
                   in ("running", "degraded"), 30, "the user manager to run")
        return self

    def systemctl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"systemd --user exited: {self.log.read_text()[-3000:]}")
        return subprocess.run(["nsenter", "-t", str(self.proc.pid), "-m", "--", "systemctl",
                               "--user", "--no-pager", *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def show(self, unit: str) -> dict[str, str]:
        props = "ActiveState,SubState,Result,MainPID,NRestarts,StatusText,NotifyAccess,Type"
        out = self.systemctl("show", unit, "-p", props).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # a user manager stops its units, then exits
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for cgroup in self.cgroups:  # empty now; the deepest first
            if cgroup.is_dir():
                for d in sorted((p for p in cgroup.rglob("*") if p.is_dir()),
                                key=lambda p: len(p.parts), reverse=True):
                    d.rmdir()
                cgroup.rmdir()


def cgroup_hierarchies() -> list[Path]:
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.procs").exists():  # cgroup v2 only
        return [root]
    # v1 and a hybrid's unified one. A new cpuset cgroup takes no process before its CPUs
    # and memory nodes are set, and systemd leaves cpuset alone.
    return [d for d in sorted(root.iterdir()) if not d.is_symlink() and d.name != "cpuset"
            and (d / "cgroup.procs").exists()]


def own_cgroups(pid: int | str) -> str:
    return Path(f"/proc/{pid}/cgroup").read_text()


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[UserManager]:
    user = UserManager(tmp_path / "user")
    started: list[int] = []
    pid1, ours = own_cgroups(1), own_cgroups("self")
    try:
        yield user.start()
        # The manager kept to its own cgroups: nothing else on the machine was moved.
        assert (own_cgroups(1), own_cgroups("self")) == (pid1, ours)
        assert user.proc is not None
        assert f"{user.cgroups[0].name}/init.scope" in own_cgroups(user.proc.pid)
    finally:
        if user.proc is not None and user.proc.poll() is None:
            props = user.show("lumend.service")
            if props.get("MainPID", "0") != "0":
                started.append(int(props["MainPID"]))
        user.stop()
        for pid in started:  # only if the manager could not stop it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_lumend_service_under_a_systemd_user_manager(
    etcd: EtcdCluster, manager: UserManager, tmp_path: Path
) -> None:
    config = tmp_path / "s1.toml"
    config.write_text(node_config_toml("s1", etcd.endpoints, "unit", free_ports(6),
                                       lease_ttl_s=3, workdir=tmp_path))
    venv = Path(sys.executable).parent
    # A Python installed under a home directory (pyenv) must stay visible: read-only homes.
    homes = ("/root", "/home", "/run/user")
    python_home = Path(sys.base_prefix).resolve()
    protect_home = "read-only" if any(python_home.is_relative_to(h) for h in homes) else "yes"
    shutil.copy(UNIT, manager.units / "lumend.service")
    dropin = manager.units / "lumend.service.d"
    dropin.mkdir()
    (dropin / "test.conf").write_text(f"""\
[Service]
ExecStartPre=
ExecStartPre={venv}/lumend check-config {config}
ExecStart=
ExecStart={venv}/lumend run --config {config}
User=
Group=
PrivateTmp=no
ReadWritePaths={tmp_path}
ProtectHome={protect_home}
""")
    manager.systemctl("daemon-reload")
    verify = manager.systemctl("show", "lumend.service", "-p", "LoadState,FragmentPath")
    assert "LoadState=loaded" in verify.stdout, verify.stdout + verify.stderr

    # Type=notify: `start` returns once lumend sent READY=1 (registered, workers serving).
    started = manager.systemctl("start", "lumend.service")
    assert started.returncode == 0, started.stderr + manager.systemctl(
        "status", "lumend.service").stdout
    props = manager.show("lumend.service")
    assert (props["Type"], props["ActiveState"], props["SubState"]) == \
        ("notify", "active", "running")
    pid = int(props["MainPID"])
    assert "serving" in props["StatusText"], props
    view = read_view(etcd.endpoints, "unit")
    assert view.nodes["s1"].pid == pid
    assert view.workers["s1-w0"].state == "serving"

    # reload: SIGHUP, lumend answers RELOADING=1 then READY=1; same process.
    reloaded = manager.systemctl("reload", "lumend.service")
    assert reloaded.returncode == 0, reloaded.stderr
    assert int(manager.show("lumend.service")["MainPID"]) == pid

    # SIGKILL: Restart=on-failure brings up a new process that registers again.
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: manager.show("lumend.service")["NRestarts"] == "1" and
               manager.show("lumend.service")["SubState"] == "running", 60,
               "systemd to restart lumend after SIGKILL")
    new_pid = int(manager.show("lumend.service")["MainPID"])
    assert new_pid != pid
    wait_until(lambda: "s1" in (v := read_view(etcd.endpoints, "unit")).nodes and
               v.nodes["s1"].pid == new_pid, 60, "the restarted lumend to register")

    # stop: SIGTERM to lumend only (KillMode=mixed), a graceful stop, a clean result.
    stopped = manager.systemctl("stop", "lumend.service")
    assert stopped.returncode == 0, stopped.stderr
    props = manager.show("lumend.service")
    assert (props["ActiveState"], props["Result"]) == ("inactive", "success"), props
    assert "s1" not in read_view(etcd.endpoints, "unit").nodes
    deadline = time.monotonic() + 10
    while Path(f"/proc/{new_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{new_pid}").exists()
