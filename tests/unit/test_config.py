"""lumend.config: the example file, every kind of mistake, sizes and listen addresses."""

import json
import re
from pathlib import Path
from typing import Any

import pytest

from lumend.checkpoint.security import CurveKeys
from lumend.config import (
    ConfigError,
    ConfigProblem,
    NodeConfig,
    load_config,
    parse_config,
    parse_listen,
    parse_size,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lumend.toml"
GiB = 1024**3
DROP = object()  # in an override: remove this key


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if value is DROP:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


BASE: dict[str, Any] = {
    "node": {"name": "n1", "address": "10.0.0.11"},
    "etcd": {"endpoints": ["http://10.0.0.1:2379"]},
}


def config_text(**overrides: Any) -> str:
    """A TOML document (tables written inline): BASE with the overrides merged in. A config
    with workers and no [checkpoint] override runs insecure (the CURVE keys have tests of
    their own below)."""
    if overrides.get("workers") and "checkpoint" not in overrides:
        overrides["checkpoint"] = {"insecure": True}
    document = _merge(BASE, overrides)
    return "\n".join(f"{key} = {_toml_value(value)}" for key, value in document.items())


def worker(**overrides: Any) -> dict[str, Any]:
    base = {"name": "w0", "gpus": [0], "engine": "sim", "model": "sim-small", "port": 8100}
    return _merge(base, overrides)


def problems_of(text: str) -> list[ConfigProblem]:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "node.toml")
    assert caught.value.source == "node.toml"
    return caught.value.problems


def problem_at(text: str, key: str) -> ConfigProblem:
    problems = problems_of(text)
    found = [problem for problem in problems if problem.key == key]
    assert found, f"no problem at {key}: {[str(p) for p in problems]}"
    return found[0]


EXAMPLE_KEYS = '"/etc/lumen/checkpoint.keys"'


@pytest.fixture
def example(tmp_path: Path) -> Path:
    """The example config, its key file path replaced by a real key file."""
    keys = tmp_path / "checkpoint.keys"
    CurveKeys.generate().write(keys)
    text = EXAMPLE.read_text()
    assert EXAMPLE_KEYS in text
    path = tmp_path / "lumend.toml"
    path.write_text(text.replace(EXAMPLE_KEYS, f'"{keys}"'))
    return path


# --------------------------------------------------------------------------- good configs


def test_example_parses_to_the_documented_values(example: Path) -> None:
    config = load_config(example)

    assert config.node.name == "gpu-node-1"
    assert config.node.address == "10.0.0.11"
    assert config.etcd.endpoints == ["http://10.0.0.1:2379"]
    assert config.etcd.endpoint_addresses == [("10.0.0.1", 2379, False)]
    assert config.etcd.cluster == "prod"
    assert config.etcd.lease_ttl_s == 10
    assert config.etcd.effective_heartbeat_s == pytest.approx(10 / 3)
    assert config.etcd.request_timeout_s == 2.0
    assert (config.etcd.ca_cert, config.etcd.cert, config.etcd.key) == (None, None, None)
    assert config.gateway.address == ("0.0.0.0", 8000)
    assert config.rpc.address == ("0.0.0.0", 7440)
    assert config.checkpoint.address == ("0.0.0.0", 7441)
    assert config.checkpoint.budget_bytes == 20 * GiB
    assert config.checkpoint.eviction == "lru"
    assert config.checkpoint.keys == str(example.parent / "checkpoint.keys")
    assert config.checkpoint.insecure is False
    assert config.metrics.address == ("0.0.0.0", 9440)
    assert config.state_dir == "/var/lib/lumen"
    assert config.runtime_dir == "/run/lumen"
    [w0] = config.workers
    assert w0.name == "gpu-node-1-w0"
    assert w0.gpus == [0, 1, 2, 3]
    assert w0.engine == "vllm"
    assert w0.shadows == 1
    assert w0.model == "/models/Qwen3-32B"
    assert w0.draft_model == "/models/Qwen3-1.7B"
    assert w0.args == ["--tensor-parallel-size", "4"]
    assert w0.port == 8100
    assert list(w0.engine_ports) == [8100, 8101]


def example_sections() -> dict[str, str]:
    """The example's text by table ("": the top level; "workers" for [[workers]])."""
    sections = {"": ""}
    current = ""
    for line in EXAMPLE.read_text().splitlines():
        header = re.match(r"\[\[?(\w+)\]\]?", line)
        if header:
            current = header.group(1)
            sections.setdefault(current, "")
        else:
            sections[current] += line + "\n"
    return sections


def test_example_documents_every_key() -> None:
    """Every key the parser accepts appears, set or commented out, in its own table of the
    example (a key added to lumend.config without a line in the example fails this)."""
    from lumend import config as c

    tables = {"node": c._NODE_KEYS, "etcd": c._ETCD_KEYS, "workers": c._WORKER_KEYS,
              **{name: known for name, (known, _) in c._SERVICES.items()}}
    tables[""] = tuple(k for k in c._TOP_KEYS if k not in tables)
    sections = example_sections()
    missing = [f"[{table}] {key}" for table, keys in tables.items() for key in keys
               if not re.search(rf"^(# )?{key} = ", sections.get(table, ""), re.M)]
    assert missing == []


def test_minimal_config_gets_the_defaults() -> None:
    config = parse_config(config_text())

    assert config.etcd.cluster == "default"
    assert config.etcd.lease_ttl_s == 10
    assert config.etcd.heartbeat_interval_s is None
    assert config.etcd.request_timeout_s == 2.0
    assert config.gateway.listen == "0.0.0.0:8000"
    assert config.rpc.listen == "0.0.0.0:7440"
    assert config.checkpoint.listen == "0.0.0.0:7441"
    assert config.checkpoint.budget_bytes == 20 * GiB
    assert config.checkpoint.eviction == "lru"
    assert (config.checkpoint.keys, config.checkpoint.insecure) == (None, False)
    assert config.metrics.listen == "0.0.0.0:9440"
    assert config.workers == []
    assert (config.state_dir, config.runtime_dir) == ("/var/lib/lumen", "/run/lumen")


def test_worker_defaults() -> None:
    [w0] = parse_config(config_text(workers=[worker()])).workers

    assert (w0.shadows, w0.draft_model, w0.args) == (1, None, [])


def test_struct_defaults_match_the_parsed_defaults() -> None:
    parsed = parse_config(config_text())

    assert NodeConfig(node=parsed.node, etcd=parsed.etcd) == parsed


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"node": {"address": "::1"}}, id="ipv6-address"),
        pytest.param({"node": {"address": "gpu-1.example.com"}}, id="hostname-address"),
        pytest.param({"node": {"name": "a" * 63}}, id="63-char-name"),
        pytest.param({"etcd": {"cluster": "prod_2.eu-west"}}, id="cluster-punctuation"),
        pytest.param({"etcd": {"lease_ttl_s": 2, "request_timeout_s": 0.5}}, id="ttl-2"),
        pytest.param({"etcd": {"lease_ttl_s": 300}}, id="ttl-300"),
        pytest.param({"etcd": {"heartbeat_interval_s": 4}}, id="int-heartbeat"),
        pytest.param({"etcd": {"endpoints": ["http://[::1]:2379"]}}, id="ipv6-endpoint"),
        pytest.param({"checkpoint": {"budget_bytes": 0}}, id="zero-budget"),
        pytest.param({"checkpoint": {"budget_bytes": "1.5KiB"}}, id="decimal-budget"),
        pytest.param({"gateway": {"listen": "[::]:8080"}}, id="ipv6-listen"),
        pytest.param({"gateway": {}}, id="empty-section-defaults"),
        pytest.param(
            {"workers": [worker(shadows=0, port=8100), worker(name="w1", gpus=[1], port=8101)]},
            id="adjacent-port-ranges",
        ),
        pytest.param({"workers": [worker(shadows=4, port=65531)]}, id="range-ends-at-65535"),
        pytest.param({"workers": []}, id="no-workers"),
    ],
)
def test_accepts(overrides: dict[str, Any]) -> None:
    parse_config(config_text(**overrides))


def test_endpoint_addresses_and_tls(tmp_path: Path) -> None:
    for name in ("ca.pem", "client.pem", "client-key.pem"):
        (tmp_path / name).write_text("pem")
    etcd = {
        "endpoints": ["https://etcd-1:2379", "https://[fd00::1]:2379"],
        "ca_cert": str(tmp_path / "ca.pem"),
        "cert": str(tmp_path / "client.pem"),
        "key": str(tmp_path / "client-key.pem"),
        "lease_ttl_s": 9,
        "heartbeat_interval_s": 1.5,
    }
    config = parse_config(config_text(etcd=etcd))

    assert config.etcd.endpoint_addresses == [("etcd-1", 2379, True), ("fd00::1", 2379, True)]
    assert config.etcd.effective_heartbeat_s == 1.5
    assert config.etcd.key == str(tmp_path / "client-key.pem")


# --------------------------------------------------------------------------- mistakes

MISTAKES = [
    # unknown keys
    ({"etcd": {"lease_ttl": 10}}, "etcd.lease_ttl", 'did you mean "lease_ttl_s"?'),
    ({"gatway": {"listen": "0.0.0.0:8000"}}, "gatway", 'did you mean "gateway"?'),
    ({"workers": [worker(gpu=[0])]}, "workers[0].gpu", 'did you mean "gpus"?'),
    ({"metrics": {"port": 9440}}, "metrics.port", "the keys there are: listen"),
    ({"node": {"state_dir": "/x"}}, "node.state_dir", "move it above the first [section]"),
    # wrong types
    ({"workers": [worker(gpus="0,1")]}, "workers[0].gpus", "expected a list of integers"),
    ({"workers": [worker(gpus=[0, "1"])]}, "workers[0].gpus[1]", "expected an integer"),
    ({"etcd": {"lease_ttl_s": "10"}}, "etcd.lease_ttl_s", "expected an integer"),
    ({"etcd": {"lease_ttl_s": True}}, "etcd.lease_ttl_s", "expected an integer"),
    ({"etcd": {"request_timeout_s": "2s"}}, "etcd.request_timeout_s", "expected a number"),
    ({"etcd": {"endpoints": "http://h:2379"}}, "etcd.endpoints", "expected a list of strings"),
    ({"etcd": {"endpoints": [2379]}}, "etcd.endpoints[0]", "expected a string"),
    ({"node": "n1"}, "node", "expected a table"),
    ({"workers": {"name": "w0"}}, "workers", "[[workers]] header (double brackets)"),
    ({"workers": [worker(args="--x")]}, "workers[0].args", "expected a list of strings"),
    ({"checkpoint": {"budget_bytes": 1.5}}, "checkpoint.budget_bytes", "use a size such as"),
    ({"state_dir": 1}, "state_dir", "expected a string"),
    # missing required keys
    ({"node": DROP}, "node", "add the [node] section"),
    ({"etcd": DROP}, "etcd", "add the [etcd] section"),
    ({"node": {"address": DROP}}, "node.address", 'add address = "10.0.0.11" to [node]'),
    ({"etcd": {"endpoints": DROP}}, "etcd.endpoints", "add endpoints = "),
    ({"workers": [worker(model=DROP)]}, "workers[0].model", "add model = "),
    ({"workers": [worker(port=DROP)]}, "workers[0].port", "add port = 8100 to [[workers]]"),
    ({"workers": [worker(gpus=DROP)]}, "workers[0].gpus", "add gpus = "),
    ({"workers": [worker(engine=DROP)]}, "workers[0].engine", 'add engine = "vllm"'),
    # names
    ({"node": {"name": "-n1"}}, "node.name", "starting with a letter or digit"),
    ({"node": {"name": ""}}, "node.name", "use 1-63 letters"),
    ({"node": {"name": "a" * 64}}, "node.name", "use 1-63 letters"),
    ({"node": {"name": "gpu node"}}, "node.name", "use 1-63 letters"),
    ({"etcd": {"cluster": "a/b"}}, "etcd.cluster", "etcd key segment"),
    ({"workers": [worker(name="w0\n")]}, "workers[0].name", "use 1-63 letters"),
    # node.address
    ({"node": {"address": "http://10.0.0.11"}}, "node.address", "remove the scheme"),
    ({"node": {"address": "10.0.0.11:7440"}}, "node.address", "remove the port"),
    ({"node": {"address": "[::1]"}}, "node.address", "remove the brackets"),
    ({"node": {"address": ""}}, "node.address", "give the host name or IP address"),
    ({"node": {"address": "0.0.0.0"}}, "node.address", "peers cannot reach"),
    ({"node": {"address": "no spaces"}}, "node.address", "give the host name or IP address"),
    # etcd endpoints
    ({"etcd": {"endpoints": []}}, "etcd.endpoints", "list at least one"),
    ({"etcd": {"endpoints": ["10.0.0.1:2379"]}}, "etcd.endpoints[0]", "no http:// or https://"),
    ({"etcd": {"endpoints": ["http://10.0.0.1"]}}, "etcd.endpoints[0]", "no port"),
    ({"etcd": {"endpoints": ["http://h:0"]}}, "etcd.endpoints[0]", "out of range 1-65535"),
    ({"etcd": {"endpoints": ["http://h:65536"]}}, "etcd.endpoints[0]", "out of range"),
    ({"etcd": {"endpoints": ["http://h:2379/v3"]}}, "etcd.endpoints[0]", "only a scheme"),
    ({"etcd": {"endpoints": ["grpc://h:2379"]}}, "etcd.endpoints[0]", "no http:// or https://"),
    ({"etcd": {"endpoints": ["https://h:2379"]}}, "etcd.ca_cert", "https endpoints need"),
    # etcd TLS files
    ({"etcd": {"ca_cert": "/nonexistent/ca.pem"}}, "etcd.ca_cert", "put the file there"),
    ({"etcd": {"cert": "/nonexistent/c.pem"}}, "etcd.cert", "put the file there or remove"),
    ({"etcd": {"cert": "/nonexistent/c.pem"}}, "etcd.key", "needs both cert and key"),
    ({"etcd": {"key": "/nonexistent/k.pem"}}, "etcd.cert", "needs both cert and key"),
    # etcd timings
    ({"etcd": {"lease_ttl_s": 1}}, "etcd.lease_ttl_s", "from 2 to 300"),
    ({"etcd": {"lease_ttl_s": 301}}, "etcd.lease_ttl_s", "from 2 to 300"),
    ({"etcd": {"heartbeat_interval_s": 5}}, "etcd.heartbeat_interval_s", "below lease_ttl_s / 2"),
    ({"etcd": {"heartbeat_interval_s": 0}}, "etcd.heartbeat_interval_s", "above 0"),
    ({"etcd": {"heartbeat_interval_s": -1.0}}, "etcd.heartbeat_interval_s", "above 0"),
    ({"etcd": {"request_timeout_s": 5.0}}, "etcd.request_timeout_s", "renewal window"),
    ({"etcd": {"request_timeout_s": 0}}, "etcd.request_timeout_s", "above 0"),
    ({"etcd": {"lease_ttl_s": 4}}, "etcd.request_timeout_s", "or raise lease_ttl_s"),
    # listen addresses
    ({"gateway": {"listen": "8000"}}, "gateway.listen", "no port"),
    ({"rpc": {"listen": "0.0.0.0:70000"}}, "rpc.listen", "out of range 1-65535"),
    ({"metrics": {"listen": "::1:9440"}}, "metrics.listen", "needs brackets"),
    ({"gateway": {"listen": 8000}}, "gateway.listen", "expected a string"),
    ({"metrics": {"listen": "0.0.0.0:8000"}}, "metrics.listen", "already used by gateway.listen"),
    ({"rpc": {"listen": "127.0.0.1:7441"}}, "checkpoint.listen", "already used by rpc.listen"),
    # checkpoint
    ({"checkpoint": {"budget_bytes": "20G"}}, "checkpoint.budget_bytes", 'unknown unit "G"'),
    ({"checkpoint": {"budget_bytes": -1}}, "checkpoint.budget_bytes", "cannot be negative"),
    ({"checkpoint": {"eviction": "fifo"}}, "checkpoint.eviction", '"lru", "shortest_prefix"'),
    # workers
    ({"workers": [worker(), worker(gpus=[1], port=8200)]}, "workers[1].name", "own name"),
    ({"workers": [worker(gpus=[])]}, "workers[0].gpus", "list at least one"),
    ({"workers": [worker(gpus=[-1])]}, "workers[0].gpus[0]", "GPU indices start at 0"),
    ({"workers": [worker(gpus=[0, 0])]}, "workers[0].gpus", "list each GPU once"),
    ({"workers": [worker(engine="trt")]}, "workers[0].engine", 'use one of "vllm", "sim"'),
    ({"workers": [worker(shadows=5)]}, "workers[0].shadows", "from 0 to 4"),
    ({"workers": [worker(shadows=-1)]}, "workers[0].shadows", "from 0 to 4"),
    ({"workers": [worker(model="")]}, "workers[0].model", "give a model path or name"),
    ({"workers": [worker(draft_model=" ")]}, "workers[0].draft_model", "give a model path"),
    ({"workers": [worker(port=0)]}, "workers[0].port", "from 1 to 65535"),
    ({"workers": [worker(port=65535)]}, "workers[0].port", "above 65535"),
    ({"workers": [worker(port=7999)]}, "workers[0].port", "overlap gateway.listen port 8000"),
    ({"workers": [worker(port=9440, shadows=0)]}, "workers[0].port", "metrics.listen port"),
    # top-level paths
    ({"state_dir": "var/lib/lumen"}, "state_dir", "use an absolute path"),
    ({"runtime_dir": "./run"}, "runtime_dir", "use an absolute path"),
]


@pytest.mark.parametrize(
    ("overrides", "key", "fix"), [pytest.param(*case, id=case[1]) for case in MISTAKES]
)
def test_mistake_names_key_value_and_fix(overrides: dict[str, Any], key: str, fix: str) -> None:
    text = config_text(**overrides)
    problem = problem_at(text, key)

    assert fix in problem.fix
    assert problem.value
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "node.toml")
    assert f"node.toml: {problem}" in str(caught.value).splitlines()


def test_shared_gpu_message() -> None:
    workers = [
        worker(name="gpu-node-1-w0", gpus=[0, 1, 2, 3]),
        worker(name="gpu-node-1-w1", gpus=[0, 1], port=8200),
    ]
    problem = problem_at(config_text(workers=workers), "workers[1].gpus")

    assert problem.value == "[0, 1]"
    assert str(problem) == (
        'workers[1].gpus = [0, 1]: GPUs 0, 1 are already used by workers[0] "gpu-node-1-w0"; '
        "give each worker its own GPUs"
    )


def test_one_shared_gpu_is_singular() -> None:
    workers = [worker(gpus=[0, 1]), worker(name="w1", gpus=[1, 2], port=8200)]
    problem = problem_at(config_text(workers=workers), "workers[1].gpus")

    assert problem.fix.startswith('GPU 1 is already used by workers[0] "w0"')


def test_overlapping_worker_ports_suggest_a_free_range() -> None:
    workers = [worker(port=8100, shadows=2), worker(name="w1", gpus=[1], port=8101)]
    problem = problem_at(config_text(workers=workers), "workers[1].port")

    assert 'overlap workers[0] "w0" (8100-8102)' in problem.fix
    assert "e.g. port = 8103" in problem.fix


def test_default_values_in_conflicts_are_marked() -> None:
    problem = problem_at(config_text(etcd={"lease_ttl_s": 4}), "etcd.request_timeout_s")

    assert problem.value == "2.0 (the default)"


def test_missing_value_reads_missing() -> None:
    problem = problem_at(config_text(node={"name": DROP}), "node.name")

    assert problem.value == "<missing>"
    assert str(problem) == 'node.name is missing: add name = "gpu-node-1" to [node]'


def test_all_mistakes_are_reported_at_once() -> None:
    text = config_text(
        state_dir="relative",
        node={"name": "-bad", "address": "http://x"},
        etcd={"endpoints": ["10.0.0.1:2379"], "lease_ttl": 10, "lease_ttl_s": 1},
        checkpoint={"budget_bytes": "lots"},
        workers=[worker(gpus="0"), worker(engine="trt", shadows=9)],
    )
    keys = {problem.key for problem in problems_of(text)}

    assert keys >= {
        "state_dir",
        "node.name",
        "node.address",
        "etcd.endpoints[0]",
        "etcd.lease_ttl",
        "etcd.lease_ttl_s",
        "checkpoint.budget_bytes",
        "workers[0].gpus",
        "workers[1].engine",
        "workers[1].shadows",
        "workers[1].name",
    }


def test_error_lists_one_problem_per_line_prefixed_by_source() -> None:
    text = config_text(node={"name": "-bad"}, etcd={"lease_ttl_s": 1})
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "/etc/lumen/lumend.toml")
    lines = str(caught.value).splitlines()

    assert len(lines) == len(caught.value.problems) == 2
    assert all(line.startswith("/etc/lumen/lumend.toml: ") for line in lines)
    assert lines[0].startswith('/etc/lumen/lumend.toml: node.name = "-bad": ')


def test_misplaced_top_level_key_after_a_section() -> None:
    text = '[node]\nname = "n1"\naddress = "10.0.0.11"\nstate_dir = "/srv/lumen"\n'
    text += '[etcd]\nendpoints = ["http://10.0.0.1:2379"]\n'
    problem = problem_at(text, "node.state_dir")

    assert "move it above the first [section] header" in problem.fix


# --------------------------------------------------------------------------- whole file


def test_toml_syntax_error() -> None:
    [problem] = problems_of('[node]\nname = "n1\n')

    assert problem.key == "<toml>"
    assert "line 2" in problem.value
    assert problem.fix == "fix the TOML syntax"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "lumend.toml"
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    [problem] = caught.value.problems

    assert caught.value.source == str(path)
    assert problem.key == "<file>"
    assert str(path) in problem.fix
    assert "--config" in problem.fix


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path)
    [problem] = caught.value.problems

    assert problem.key == "<file>"
    assert "--config" in problem.fix


def test_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "lumend.toml"
    path.write_bytes(b'[node]\nname = "\xff"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path)

    assert caught.value.problems[0].fix == "save it as UTF-8"


def test_load_config_reports_problems_with_the_path(tmp_path: Path) -> None:
    path = tmp_path / "lumend.toml"
    path.write_text(config_text(node={"name": "-bad"}))
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))

    assert str(caught.value).startswith(f"{path}: node.name")


# --------------------------------------------------------------------------- parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("20GiB", 20 * GiB),
        ("20GB", 20 * 10**9),
        ("20 GiB", 20 * GiB),
        ("20gib", 20 * GiB),
        ("1B", 1),
        ("1KB", 1000),
        ("1KiB", 1024),
        ("3MB", 3 * 10**6),
        ("3MiB", 3 * 1024**2),
        ("1TB", 10**12),
        ("1TiB", 1024**4),
        ("1.5KiB", 1536),
        ("0.5GB", 5 * 10**8),
        ("512", 512),
        ("0", 0),
        (" 7 ", 7),
        (512, 512),
        (0, 0),
    ],
)
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("20G", 'unknown unit "G"'),
        ("20 bytes", 'unknown unit "bytes"'),
        ("1PiB", 'unknown unit "PiB"'),
        ("", "not a size"),
        ("GiB", "not a size"),
        ("-1", "not a size"),
        ("1e9", "not a size"),
        ("1,000", "not a size"),
        ("twenty", "not a size"),
        ("1.5B", "not a whole number of bytes"),
        (-1, "cannot be negative"),
        (True, "cannot be a boolean"),
    ],
)
def test_parse_size_rejects(text: str | int, message: str) -> None:
    with pytest.raises(ValueError, match="use a size such as") as caught:
        parse_size(text)
    assert message in str(caught.value)


# --------------------------------------------------------------------------- parse_listen


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("0.0.0.0:8000", ("0.0.0.0", 8000)),
        ("127.0.0.1:1", ("127.0.0.1", 1)),
        ("localhost:65535", ("localhost", 65535)),
        ("gpu-1.example.com:7440", ("gpu-1.example.com", 7440)),
        ("[::1]:8000", ("::1", 8000)),
        ("[::]:8000", ("::", 8000)),
    ],
)
def test_parse_listen(text: str, address: tuple[str, int]) -> None:
    assert parse_listen(text) == address


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("8000", "no port"),
        ("", "no port"),
        ("host:", "no port"),
        (":8000", "no host"),
        ("::1:8000", "needs brackets"),
        ("[::1]", "bracketed IPv6"),
        ("[::1]8000", "bracketed IPv6"),
        ("[host]:8000", "bracketed IPv6"),
        ("host:0", "out of range 1-65535"),
        ("host:65536", "out of range 1-65535"),
        ("host:http", "is not a number"),
        ("host:+80", "is not a number"),
        ("host: 80", "is not a number"),
        ("http://host:80", "remove the scheme"),
        ("my host:80", "not a host name"),
    ],
)
def test_parse_listen_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="use host:port") as caught:
        parse_listen(text)
    assert message in str(caught.value)


def test_sim_workers_name_a_sim_preset(example: Path) -> None:
    text = example.read_text().replace('engine = "vllm"', 'engine = "sim"')
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert any(p.key == "workers[0].model" and "sim-small" in p.fix for p in info.value.problems)
    # A sim worker's draft_model names a sim drafter (draft-assist), not a model path.
    ok = text.replace('model = "/models/Qwen3-32B"', 'model = "sim-small"')
    with pytest.raises(ConfigError) as info:
        parse_config(ok)
    assert any(p.key == "workers[0].draft_model" and "sim-draft" in p.fix
               for p in info.value.problems)
    ok = ok.replace('draft_model = "/models/Qwen3-1.7B"', 'draft_model = "sim-draft"')
    assert parse_config(ok).workers[0].model == "sim-small"


# --------------------------------------------------------------------------- CURVE keys


def secure(keys: str | None = None, **checkpoint: Any) -> str:
    settings = {**checkpoint, **({"keys": keys} if keys is not None else {})}
    return config_text(checkpoint=settings, workers=[worker()])


def test_a_node_with_workers_needs_keys_or_insecure() -> None:
    problem = problem_at(secure(), "checkpoint.keys")

    assert problem.value == "<missing>"
    assert 'add keys = "/etc/lumen/checkpoint.keys" to [checkpoint]' in problem.fix
    assert "lumenctl keys generate /etc/lumen/checkpoint.keys" in problem.fix
    assert "insecure = true" in problem.fix
    # Controls: insecure said out loud, or a node without workers, needs no keys.
    assert parse_config(secure(insecure=True)).checkpoint.insecure is True
    assert parse_config(config_text()).checkpoint.keys is None


def test_a_good_key_file_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.keys"
    CurveKeys.generate().write(path)

    config = parse_config(secure(str(path)))

    assert (config.checkpoint.keys, config.checkpoint.insecure) == (str(path), False)


def test_key_file_problems_name_the_file_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.keys"
    missing = problem_at(secure(str(path)), "checkpoint.keys")
    assert f"lumenctl keys generate {path}" in missing.fix

    CurveKeys.generate().write(path)
    path.chmod(0o644)
    readable = problem_at(secure(str(path)), "checkpoint.keys")
    assert f"chmod 600 {path}" in readable.fix

    path.write_text("server_public = [")
    path.chmod(0o600)
    assert "is not TOML" in problem_at(secure(str(path)), "checkpoint.keys").fix


@pytest.mark.parametrize(("checkpoint", "key", "fix"), [
    ({"keys": "checkpoint.keys"}, "checkpoint.keys", "use an absolute path"),
    ({"keys": 7}, "checkpoint.keys", "expected a string"),
    ({"insecure": "yes"}, "checkpoint.insecure", "expected true or false"),
    ({"insecure": True, "keys": "/etc/lumen/checkpoint.keys"}, "checkpoint.insecure",
     "keys is set too"),
])
def test_keys_and_insecure_mistakes(checkpoint: dict[str, Any], key: str, fix: str) -> None:
    assert fix in problem_at(config_text(checkpoint=checkpoint, workers=[worker()]), key).fix
