"""The vLLM command line and environment lumend builds, on CPU and on CUDA machines."""

from __future__ import annotations

import json

from lumend.engine.adapter import (
    ENGINE_URL_ENV,
    LUMEN_KV_TRANSFER_CONFIG,
    SLEEP_MODE_ENV,
    EngineSpec,
    VllmAdapter,
)


def spec(args: tuple[str, ...] = (), gpus: tuple[int, ...] = (0,),
         gms: str | None = None) -> EngineSpec:
    return EngineSpec(engine_id="w0/1", host="127.0.0.1", port=8101, model="/models/m",
                      args=args, gms_socket=gms, failover_lock="/run/lumen/w0/failover.lock",
                      gpus=gpus)


def option(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_cpu_engine_gets_the_lumen_connector_and_no_sleep_mode() -> None:
    adapter = VllmAdapter(cuda=False)
    assert not adapter.uses_gms
    cmd = adapter.command(spec())
    config = json.loads(option(cmd, "--kv-transfer-config") or "{}")
    assert config == json.loads(LUMEN_KV_TRANSFER_CONFIG)
    assert config["kv_connector_module_path"] == "lumend.engine.vllm_connector"
    assert config["kv_load_failure_policy"] == "recompute"
    assert "--enable-sleep-mode" not in cmd and "--worker-cls" not in cmd
    env = adapter.environment(spec())
    assert SLEEP_MODE_ENV not in env and "VLLM_SERVER_DEV_MODE" not in env


def test_the_operators_own_connector_and_tp_size_win() -> None:
    adapter = VllmAdapter(cuda=False)
    own = ("--kv-transfer-config", '{"kv_connector":"Theirs"}', "--tensor-parallel-size", "4")
    cmd = adapter.command(spec(args=own, gpus=(0, 1)))
    assert cmd.count("--kv-transfer-config") == 1 and option(cmd, "--kv-transfer-config") == (
        '{"kv_connector":"Theirs"}')
    assert cmd.count("--tensor-parallel-size") == 1
    assert option(adapter.command(spec(gpus=(0, 1))), "--tensor-parallel-size") == "2"
    assert "--tensor-parallel-size" not in adapter.command(spec(gpus=(3,)))


def test_single_gpu_engine_on_cuda_maps_weights_from_gms_and_sleeps() -> None:
    adapter = VllmAdapter(cuda=True)
    assert adapter.uses_gms and adapter.gms_backend == "cuda"
    s = spec(gms="/run/lumen/w0/gms.sock")
    cmd = adapter.command(s)
    assert "--enable-sleep-mode" in cmd
    assert option(cmd, "--worker-cls") == "lumend.engine.vllm_gms_worker.LumenGmsWorker"
    env = adapter.environment(s)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env[SLEEP_MODE_ENV] == "1"
    assert env[ENGINE_URL_ENV] == "http://127.0.0.1:8101"
    assert "/run/lumen/w0/gms.sock" in env.values()


def test_multi_gpu_engine_on_cuda_sleeps_without_gms() -> None:
    adapter = VllmAdapter(cuda=True)
    cmd = adapter.command(spec(gpus=(0, 1)))
    assert "--enable-sleep-mode" in cmd and "--worker-cls" not in cmd
    assert adapter.environment(spec(gpus=(0, 1)))[SLEEP_MODE_ENV] == "1"
