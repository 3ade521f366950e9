"""The vLLM GMS worker's CPU-checkable parts: its arguments, lazy import, registration, and
how it reads GMS before vLLM sizes its memory. (Mapping weights needs a GPU:
bench/gpu/gms_check.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from lumend.engine.vllm_gms_worker import (
    GMS_SOCKET_ENV,
    LOAD_FORMAT,
    WORKER_CLS,
    GmsWeights,
    committed_weight_bytes,
    gpu_engine_args,
    socket_for,
)
from lumend.gms.protocol import TensorMeta

from .conftest import GmsProcess


def test_engine_args_turn_on_sleep_mode_and_the_worker() -> None:
    args, env = gpu_engine_args("/run/lumen/w0/gms.sock")
    assert args == ["--enable-sleep-mode", "--worker-cls", WORKER_CLS]
    assert env == {"VLLM_SERVER_DEV_MODE": "1", GMS_SOCKET_ENV: "/run/lumen/w0/gms.sock"}


def test_socket_template_names_one_gms_per_gpu() -> None:
    assert socket_for("/run/lumen/w0/gms-{rank}.sock", 3, 1) == "/run/lumen/w0/gms-3.sock"
    assert socket_for("/run/gms-dev{device}.sock", 3, 1) == "/run/gms-dev1.sock"
    assert socket_for("/run/gms.sock", 3, 1) == "/run/gms.sock"


def test_importing_the_module_does_not_import_vllm() -> None:
    code = ("import sys, lumend.engine.vllm_gms_worker as m; m.gpu_engine_args('s'); "
            "print(sorted(k for k in sys.modules if k == 'vllm' or k.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_vllm_resolves_the_worker_class_and_the_loader() -> None:
    pytest.importorskip("vllm")
    code = """
import lumend.engine.vllm_gms_worker as m
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.worker.gpu_worker import Worker
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
cls = resolve_obj_by_qualname(m.WORKER_CLS)
assert issubclass(cls, Worker) and cls.__qualname__ == "LumenGmsWorker"
for name in ("init_device", "sleep", "wake_up", "_maybe_get_memory_pool_context",
             "reload_weights"):
    assert name in vars(cls), name
try:
    get_model_loader(LoadConfig(load_format=m.LOAD_FORMAT))
except RuntimeError as exc:
    print("refused:", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"refused: the {LOAD_FORMAT} loader runs only inside {WORKER_CLS}" in out.stdout


def test_external_weight_bytes_come_from_the_committed_layout(gms: GmsProcess) -> None:
    sock = str(gms.socket)
    assert committed_weight_bytes(sock, timeout_s=1) == 0  # empty: this engine will write
    with gms.client() as writer:
        writer.hello("writer")
        alloc, size = writer.allocate("weights", 3 * 4096 + 1)
        # A writer still loading: the engine waits for its commit (here: until timeout).
        assert committed_weight_bytes(sock, timeout_s=0.3) == 0
        writer.put_tensor(TensorMeta(name="w", allocation=alloc, offset=0, shape=[8],
                                     dtype="float32"))
        writer.commit()
        assert committed_weight_bytes(sock, timeout_s=1) == size == 4 * 4096


def test_a_host_gms_is_refused_by_the_gpu_worker(gms: GmsProcess) -> None:
    with gms.client() as writer:
        writer.hello("writer")
        writer.commit()
    weights = GmsWeights(socket=str(gms.socket), timeout_s=2, original_format="auto")
    with pytest.raises(RuntimeError, match=r"host backend.*--backend cuda"):
        weights.connect("reader")
    assert weights.client is None
