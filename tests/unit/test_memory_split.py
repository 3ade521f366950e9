"""The memory split lumend computes for a vLLM worker with shadows whose operator set none
(issue 17): each engine's kv_cache_bytes from the smallest GPU's total (nvidia-smi) and the
model's weight files, used by the supervisor as if configured and printed by check-config.

No GPU here: a fake `nvidia-smi` on PATH (a real executable that prints a total) and a
model directory with a sparse weights file of the right size stand in for the hardware.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lumend.config import WorkerConfig, parse_config
from lumend.engine.adapter import VllmAdapter
from lumend.engine.vllm_memory import ENGINE_RESERVE_BYTES, KV_HEADROOM, default_kv_cache_bytes
from lumend.failover.supervisor import WorkerSupervisor

GiB, MiB = 1024**3, 1024**2
H100_MIB = 81559  # what nvidia-smi reports for an 80 GB H100: 79.6 GiB
H100 = H100_MIB * MiB
QWEN3_32B = 61 * GiB  # Qwen3-32B in bf16: 65.5 GB of safetensors

NODE = """
[node]
name = "n1"
address = "10.0.0.1"
[etcd]
endpoints = ["http://10.0.0.1:2379"]
[checkpoint]
insecure = true
[[workers]]
name = "w0"
gpus = {gpus}
engine = "vllm"
model = "{model}"
port = 8100
"""


# -- the rule (known answers) -----------------------------------------------------------

def test_qwen3_32b_over_four_80gb_gpus() -> None:
    # No GMS: each engine its own quarter of the weights. 0.9 x 79.6 / 2 - 15.25 - 4
    # = 16.59 GiB, the example config's hand-made 16 GiB rounded the other way.
    kv = default_kv_cache_bytes(H100, QWEN3_32B, 4, 1)
    assert kv == 16989 * MiB
    assert 2 * (QWEN3_32B // 4 + kv + ENGINE_RESERVE_BYTES) <= KV_HEADROOM * H100
    more = kv + MiB
    assert 2 * (QWEN3_32B // 4 + more + ENGINE_RESERVE_BYTES) > KV_HEADROOM * H100


def test_qwen3_32b_on_one_80gb_gpu_counts_the_gms_weights_once() -> None:
    # (0.9 x 79.6 - 61) / 2 - 4 = 1.34 GiB: tight, but two engines fit.
    kv = default_kv_cache_bytes(H100, QWEN3_32B, 1, 1)
    assert kv == 1373 * MiB
    assert QWEN3_32B + 2 * (kv + ENGINE_RESERVE_BYTES) <= KV_HEADROOM * H100
    # Were the weights not shared, two copies would not fit at all.
    with pytest.raises(ValueError, match="leave no room"):
        default_kv_cache_bytes(H100, QWEN3_32B, 1, 1, weights_shared=False)


def test_shadows_beyond_one_sleep_and_no_shadow_has_the_gpu_alone() -> None:
    assert default_kv_cache_bytes(H100, QWEN3_32B, 4, 3) == default_kv_cache_bytes(
        H100, QWEN3_32B, 4, 1)
    alone = default_kv_cache_bytes(H100, QWEN3_32B, 4, 0)
    assert QWEN3_32B // 4 + alone + ENGINE_RESERVE_BYTES <= KV_HEADROOM * H100
    assert alone > 2 * default_kv_cache_bytes(H100, QWEN3_32B, 4, 1)


def test_a_model_that_does_not_fit_twice_names_the_fix() -> None:
    with pytest.raises(ValueError) as err:
        default_kv_cache_bytes(H100, 131 * GiB, 1, 1)  # a 70B in bf16 on one GPU
    said = str(err.value)
    assert "weights 131.0 GiB" in said and "79.6 GiB GPU" in said
    assert "set shadows = 0 or use more GPUs" in said


# -- the supervisor uses it as if configured --------------------------------------------

def fake_nvidia_smi(tmp_path: Path, total_mib: int) -> Path:
    """A directory holding an `nvidia-smi` that reports `total_mib` for each GPU asked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n"
                   'for a in "$@"; do case "$prev" in -i) ids=$a;; esac; prev=$a; done\n'
                   f'echo "$ids" | tr , "\\n" | while read -r _; do echo {total_mib}; done\n')
    smi.chmod(0o755)
    return bin_dir


def model_dir(tmp_path: Path, weight_bytes: int) -> Path:
    model = tmp_path / "Qwen3-32B"
    model.mkdir()
    with (model / "model-00001-of-00001.safetensors").open("wb") as f:
        f.truncate(weight_bytes)  # sparse: its size is all that is read
    (model / "config.json").write_text("{}")
    return model


def worker(model: Path, gpus: str = "[0, 1, 2, 3]", extra: str = "") -> WorkerConfig:
    return parse_config(NODE.format(gpus=gpus, model=model) + extra).workers[0]


def supervisor(tmp_path: Path, w: WorkerConfig) -> WorkerSupervisor:
    return WorkerSupervisor("n1", w, VllmAdapter(cuda=True), runtime_dir=tmp_path / "run",
                            log_dir=tmp_path / "logs")


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_supervisor_chooses_the_kv_cache_and_vllm_gets_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path, H100_MIB)}:{os.environ['PATH']}")
    sup = supervisor(tmp_path, worker(model_dir(tmp_path, QWEN3_32B)))
    with caplog.at_level(logging.INFO, "lumend.failover"):
        sup.plan_memory()
    assert [s.spec.kv_cache_bytes for s in sup.slots] == [16989 * MiB] * 2
    [said] = [r.getMessage() for r in caplog.records if "kv_cache_bytes" in r.getMessage()]
    assert said == ("worker w0: no kv_cache_bytes set: 16.6 GiB per engine (GPU 79.6 GiB, "
                    "weights 61.0 GiB over 4 GPUs, 15.2 per GPU in each engine, 2 engines, "
                    "0.9 headroom)")
    cmd = sup.adapter.command(sup._memory_plan(sup.slots[1].spec))
    assert flag(cmd, "--kv-cache-memory-bytes") == str(16989 * MiB)
    # No GMS over 4 GPUs: (KV 16989 + reserve 4096) / 81559 MiB = 0.25852, rounded up.
    assert flag(cmd, "--gpu-memory-utilization") == "0.2586"


def test_supervisor_on_one_gpu_logs_the_gms_split(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path, H100_MIB)}:{os.environ['PATH']}")
    sup = supervisor(tmp_path, worker(model_dir(tmp_path, QWEN3_32B), gpus="[0]"))
    with caplog.at_level(logging.INFO, "lumend.failover"):
        sup.plan_memory()
    assert sup.slots[0].spec.kv_cache_bytes == 1373 * MiB
    assert any("1.3 GiB per engine (GPU 79.6 GiB, weights 61.0 GiB in GMS, 2 engines"
               in r.getMessage() for r in caplog.records)


def test_a_configured_split_is_left_alone(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path, H100_MIB)}:{os.environ['PATH']}")
    model = model_dir(tmp_path, QWEN3_32B)
    sup = supervisor(tmp_path, worker(model, extra='kv_cache_bytes = "8GiB"\n'))
    sup.plan_memory()
    assert sup.slots[0].spec.kv_cache_bytes == 8 * GiB
    cmd = sup.adapter.command(sup._memory_plan(sup.slots[0].spec))
    assert flag(cmd, "--gpu-memory-utilization") == "0.1507"  # (8 + 4) / 79.6, rounded up
    fraction = supervisor(tmp_path, worker(
        model, extra='args = ["--gpu-memory-utilization", "0.4"]\n'))
    fraction.plan_memory()
    assert fraction.slots[0].spec.kv_cache_bytes is None


def test_without_nvidia_smi_the_supervisor_warns_and_chooses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    sup = supervisor(tmp_path, worker(model_dir(tmp_path, QWEN3_32B)))
    sup.plan_memory()
    assert [s.spec.kv_cache_bytes for s in sup.slots] == [None, None]
    [warned] = [r for r in caplog.records if r.levelno == logging.WARNING
                and "kv_cache_bytes" in r.getMessage()]
    assert "nvidia-smi reports no memory" in warned.getMessage()
    assert "set kv_cache_bytes" in warned.getMessage()
    cmd = sup.adapter.command(sup._memory_plan(sup.slots[1].spec))
    assert "--kv-cache-memory-bytes" not in cmd and "--gpu-memory-utilization" not in cmd


def test_weights_too_large_the_supervisor_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path, H100_MIB)}:{os.environ['PATH']}")
    sup = supervisor(tmp_path, worker(model_dir(tmp_path, 131 * GiB), gpus="[0]"))
    sup.plan_memory()
    assert sup.slots[0].spec.kv_cache_bytes is None
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "set shadows = 0 or use more GPUs" in error.getMessage()


# -- check-config -----------------------------------------------------------------------

def check(tmp_path: Path, model: Path, *args: str, gpus: str = "[0, 1, 2, 3]"
          ) -> tuple[int, str, str]:
    from lumend.cli import app

    config = tmp_path / "lumend.toml"
    config.write_text(NODE.format(gpus=gpus, model=model))
    result = CliRunner().invoke(app, ["check-config", str(config), *args])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    import lumend.engine.adapter as adapter

    # /dev/nvidiactl: the driver's device node, which no test can create.
    monkeypatch.setattr(adapter, "cuda_present", lambda: True)


@pytest.mark.usefixtures("gpu_host")
def test_check_config_prints_the_computed_split_and_passes_strict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path, H100_MIB)}:{os.environ['PATH']}")
    code, out, err = check(tmp_path, model_dir(tmp_path, QWEN3_32B), "--strict")
    assert (code, err) == (0, "")
    assert "workers 'w0': no kv_cache_bytes set: lumend will choose 16.6 GiB per engine" in out


@pytest.mark.usefixtures("gpu_host")
def test_check_config_without_nvidia_smi_still_fails_strict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    code, out, err = check(tmp_path, model_dir(tmp_path, QWEN3_32B), "--strict")
    assert code == 2 and "lumend will choose" not in out
    assert "nvidia-smi reports no memory" in err and "set kv_cache_bytes" in err


@pytest.mark.usefixtures("gpu_host")
def test_check_config_with_weights_too_large_fails_strict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path, H100_MIB)}:{os.environ['PATH']}")
    code, out, err = check(tmp_path, model_dir(tmp_path, 131 * GiB), "--strict", gpus="[0]")
    assert code == 2 and "lumend will choose" not in out
    assert "none fits" in err and "set shadows = 0 or use more GPUs" in err
