"""API keys on the gateway: the key file, check-config, and a real lumend's gateway refusing
requests without a valid `Authorization: Bearer` key (401, OpenAI-style, counted), keeping
/health open, and taking new keys on SIGHUP."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from lumenctl.demo import read_view
from lumenctl.localcluster import LocalCluster, LumendNode, node_config_toml
from lumend.engine.sim_core import decode, encode, reference_completion
from lumend.gateway.auth import ApiKeyFileError, ApiKeys, Denied

from ..integration.conftest import wait_until
from ..integration.test_coordinator import metric

KEY_A = "sk-alpha-0123456789abcdef"
KEY_B = "sk-bravo-0123456789abcdef"
KEY_C = "sk-charlie-0123456789abcdef"


def key_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


# -- the key file -----------------------------------------------------------------------


def test_key_file_lines_names_and_comments() -> None:
    keys = ApiKeys.parse(f"# clients\n\n  team-a: {KEY_A}\n{KEY_B}\n   # old: gone\n")
    assert keys.names == ["team-a", "line-4"]
    assert keys.check(f"Bearer {KEY_A}") == "team-a"
    assert keys.check(f"bearer   {KEY_B} ") == "line-4"
    # Negative controls: a wrong key, a prefix of a right one, no header, another scheme.
    assert keys.check(f"Bearer {KEY_C}") == Denied("authentication_error", "incorrect API key")
    assert isinstance(keys.check(f"Bearer {KEY_A[:-1]}"), Denied)
    for header in (None, "", "Bearer", f"Basic {KEY_A}", KEY_A):
        outcome = keys.check(header)
        assert isinstance(outcome, Denied) and outcome.kind == "invalid_request_error", header


@pytest.mark.parametrize(("text", "problem"), [
    ("", "holds no key"),
    ("# only a comment\n", "holds no key"),
    ("short\n", "line 1: the key is shorter than 16"),
    (f"a: {KEY_A}\na: {KEY_B}\n", "line 2: the name 'a' is used on line 1"),
    (f"a: {KEY_A}\nb: {KEY_A}\n", "line 2: the same key is on line 1"),
    (f"bad name: {KEY_A}\n", "line 1: the name before ':'"),
    (f"x: {KEY_A} {KEY_B}\n", "line 1: the key must be printable ASCII without spaces"),
])
def test_bad_key_files_name_the_line_and_never_the_key(text: str, problem: str) -> None:
    with pytest.raises(ApiKeyFileError) as caught:
        ApiKeys.parse(text, "/etc/lumen/api-keys")
    assert problem in str(caught.value)
    assert KEY_A not in str(caught.value) and KEY_B not in str(caught.value)


def test_key_file_must_be_private_and_readable(tmp_path: Path) -> None:
    path = key_file(tmp_path / "keys", KEY_A + "\n")
    assert ApiKeys.load(path).names == ["line-1"]
    path.chmod(0o640)
    with pytest.raises(ApiKeyFileError, match=r"mode 0640.*chmod 600"):
        ApiKeys.load(path)
    with pytest.raises(ApiKeyFileError, match="does not exist; create it"):
        ApiKeys.load(tmp_path / "absent")
    with pytest.raises(ApiKeyFileError, match="not a regular file"):
        ApiKeys.load(tmp_path)


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lumend", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_check_config_names_the_key_file_and_the_fix(tmp_path: Path) -> None:
    def config(api_keys: Path | str) -> Path:
        path = tmp_path / "lumend.toml"
        path.write_text(node_config_toml("n1", ["http://127.0.0.1:2379"], "c",
                                         [8000, 8001, 8002, 8003, 8004], lease_ttl_s=10,
                                         workers=0, workdir=tmp_path, insecure=True,
                                         api_keys=Path(api_keys)))
        return path

    keys = key_file(tmp_path / "api-keys", f"a: {KEY_A}\n")
    assert check_config(config(keys)).returncode == 0
    keys.chmod(0o644)
    result = check_config(config(keys))
    assert result.returncode == 2
    assert "gateway.api_keys" in result.stdout + result.stderr
    assert f"chmod 600 {keys}" in result.stdout + result.stderr
    result = check_config(config(tmp_path / "missing"))
    assert result.returncode == 2 and "does not exist; create it" in result.stdout + result.stderr
    result = check_config(config("relative/keys"))
    assert result.returncode == 2 and "use an absolute path" in result.stdout + result.stderr
    if os.geteuid() != 0:  # root reads any file
        keys.chmod(0o000)
        result = check_config(config(keys))
        assert result.returncode == 2 and "cannot be read" in result.stdout + result.stderr


# -- a real lumend ------------------------------------------------------------------------


def call(url: str, key: str | None = None, body: dict[str, Any] | None = None,
         header: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if header is not None:
        headers["Authorization"] = header
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def gateway_status(node: LumendNode, path: str, key: str | None) -> int:
    return call(node.gateway + path, key)[0]


@pytest.fixture
def cluster(tmp_path: Path) -> Any:
    clusters: list[LocalCluster] = []

    def make(**kwargs: Any) -> LocalCluster:
        c = LocalCluster(tmp_path / f"cluster{len(clusters)}", size=1, lease_ttl_s=3,
                         shadows=0, **kwargs)
        clusters.append(c)
        return c.start()

    try:
        yield make
    finally:
        for c in clusters:
            c.stop()


def test_gateway_refuses_requests_without_a_valid_key_and_reloads_keys(
        tmp_path: Path, cluster: Any) -> None:
    keys = key_file(tmp_path / "api-keys", f"# clients\nteam-a: {KEY_A}\n{KEY_B}\n")
    c = cluster(api_keys=keys)
    node = c.node("node-1")
    wait_until(lambda: any(w.state == "serving" for w in
                           read_view(c.endpoints, c.cluster).workers.values()), 60,
               "the worker serving")
    wait_until(lambda: gateway_status(node, "/health", None) == 200, 30,
               "the gateway to see the worker (/health without a key)")

    # /v1/models and completions need a key; the errors are OpenAI's shape.
    status, body = call(node.gateway + "/v1/models")
    assert status == 401
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in body["error"]["message"]
    status, body = call(node.gateway + "/v1/models", KEY_C)
    assert (status, body["error"]["type"]) == (401, "authentication_error")
    status, body = call(node.gateway + "/v1/models", header=f"Basic {KEY_A}")
    assert (status, body["error"]["type"]) == (401, "invalid_request_error")
    prompt = "an authenticated request"
    completion = {"prompt": prompt, "max_tokens": 12}
    status, body = call(node.gateway + "/v1/completions", None, completion)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"

    status, body = call(node.gateway + "/v1/models", KEY_A)
    assert status == 200 and body["data"][0]["id"] == "sim-small"
    status, body = call(node.gateway + "/v1/completions", KEY_B, completion)
    assert status == 200
    assert body["choices"][0]["text"] == decode(reference_completion(0, encode(prompt), 12))

    assert metric(node, "lumen_gateway_rejected_total", '{type="invalid_request_error"}') == 3
    assert metric(node, "lumen_gateway_rejected_total", '{type="authentication_error"}') == 1
    assert metric(node, "lumen_gateway_api_keys") == 2
    log = node.log_text()
    assert "gateway: 2 API keys from" in log and "is open" not in log
    assert "refused 1 requests without a valid API key" in log
    assert KEY_A not in log and KEY_C not in log

    # SIGHUP: new contents of the same file replace the keys.
    key_file(keys, f"team-c: {KEY_C}\n")
    node.signal(signal.SIGHUP)
    wait_until(lambda: gateway_status(node, "/v1/models", KEY_C) == 200, 30,
               "the new key accepted after SIGHUP")
    assert gateway_status(node, "/v1/models", KEY_A) == 401
    assert metric(node, "lumen_gateway_api_keys") == 1

    # A file made unusable is refused on reload; the gateway keeps the keys it has.
    keys.chmod(0o644)
    node.signal(signal.SIGHUP)
    wait_until(lambda: "reload rejected" in node.log_text(), 30, "the reload refused")
    assert gateway_status(node, "/v1/models", KEY_C) == 200
    assert gateway_status(node, "/v1/models", None) == 401

    # Removing api_keys from the config opens the gateway, live.
    config = node.config_path.read_text()
    node.config_path.write_text(re.sub(r"(?m)^api_keys = .*\n", "", config))
    node.signal(signal.SIGHUP)
    wait_until(lambda: gateway_status(node, "/v1/models", None) == 200, 30,
               "the gateway open after api_keys was removed")
    assert "the API is open to anyone" in node.log_text()


def test_without_a_key_file_the_gateway_is_open_and_says_so(cluster: Any) -> None:
    c = cluster(workers_per_node=0)
    node = c.node("node-1")
    wait_until(lambda: "is open to anyone who can reach it" in node.log_text(), 60,
               "the gateway's start log line")
    status, body = call(node.gateway + "/v1/models")
    assert (status, body["data"]) == (200, [])
    assert call(node.gateway + "/v1/models", KEY_C)[0] == 200  # a key is simply not needed


# -- the Ansible role ---------------------------------------------------------------------


def test_ansible_role_writes_a_key_file_lumend_accepts(tmp_path: Path) -> None:
    """The role's templates, rendered as Ansible renders them (trim_blocks), give a key file
    that lumend loads with the same names and a lumend.toml that names it only when there
    are keys."""
    import jinja2

    role = Path(__file__).parents[2] / "ansible/roles/lumend/templates"
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(role), trim_blocks=True,
                             undefined=jinja2.StrictUndefined)
    env.filters["to_json"] = json.dumps
    keys = [{"name": "team-a", "key": KEY_A}, KEY_B]
    path = key_file(tmp_path / "api-keys",
                    env.get_template("api-keys.j2").render(lumend_api_keys=keys))
    loaded = ApiKeys.load(path)
    assert loaded.names == ["team-a", "line-4"]
    assert loaded.check(f"Bearer {KEY_B}") == "line-4"

    variables: dict[str, Any] = {
        "lumend_state_dir": "/var/lib/lumen", "lumend_runtime_dir": "/run/lumen",
        "lumend_node_name": "n1", "lumend_address": "127.0.0.1",
        "lumend_etcd_endpoints": ["http://127.0.0.1:2379"], "lumend_cluster": "c",
        "lumend_etcd_lease_ttl_s": 10, "lumend_etcd_request_timeout_s": 2.0,
        "lumend_etcd_tls": False, "lumend_gateway_listen": "127.0.0.1:8000",
        "lumend_rpc_listen": "127.0.0.1:7440", "lumend_checkpoint_listen": "127.0.0.1:7441",
        "lumend_checkpoint_budget": "1GiB", "lumend_checkpoint_eviction": "lru",
        "lumend_checkpoint_insecure": True, "lumend_metrics_listen": "127.0.0.1:9440",
        "lumend_gateway_drain_s": 30, "lumend_rpc_insecure": True,
        "lumend_workers": [], "lumend_api_keys_file": str(path),
    }
    config = tmp_path / "lumend.toml"
    for given, named in (([], False), (keys, True)):
        config.write_text(env.get_template("lumend.toml.j2").render(
            **variables, lumend_api_keys=given))
        assert (f'api_keys = "{path}"' in config.read_text()) == named
        result = check_config(config)
        assert result.returncode == 0, result.stdout + result.stderr
