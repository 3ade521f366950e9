"""The vLLM GMS workers' parts that need no engine: their arguments, lazy import,
registration, the configurations they refuse, how they read GMS before vLLM sizes its
memory, and their errors when GMS is missing, of the wrong kind or changed during sleep.
(Engines: tests/vllm/test_vllm_gms_twin.py; GPU mappings: bench/gpu/.)"""

from __future__ import annotations

import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from lumend.engine.gms_loader import (
    GmsUnavailable,
    GmsWeights,
    Platform,
    check_speculative,
    check_vllm_version,
)
from lumend.engine.vllm_gms_cpu_worker import cpu_platform
from lumend.engine.vllm_gms_worker import (
    CPU_WORKER_CLS,
    GMS_SOCKET_ENV,
    LOAD_FORMAT,
    WORKER_CLS,
    committed_weight_bytes,
    gms_engine_args,
    gpu_engine_args,
    socket_for,
)
from lumend.gms.client import LayoutMismatch
from lumend.gms.host_vmm import host_tensor_base
from lumend.gms.protocol import TensorMeta

from .conftest import GmsProcess, start_gms


def test_engine_args_per_platform() -> None:
    args, env = gms_engine_args("cuda", "/run/lumen/w0/gms.sock")
    assert args == ["--enable-sleep-mode", "--worker-cls", WORKER_CLS]
    assert env == {"VLLM_SERVER_DEV_MODE": "1", GMS_SOCKET_ENV: "/run/lumen/w0/gms.sock"}
    assert gpu_engine_args("/run/lumen/w0/gms.sock") == (args, env)
    args, env = gms_engine_args("cpu", "/run/lumen/w0/gms.sock")
    assert args == ["--worker-cls", CPU_WORKER_CLS]  # vLLM has no sleep mode on CPU
    assert env == {GMS_SOCKET_ENV: "/run/lumen/w0/gms.sock"}
    with pytest.raises(ValueError, match="unknown platform 'rocm'"):
        gms_engine_args("rocm", "s")  # type: ignore[arg-type]


def test_socket_template_names_one_gms_per_gpu() -> None:
    assert socket_for("/run/lumen/w0/gms-{rank}.sock", 3, 1) == "/run/lumen/w0/gms-3.sock"
    assert socket_for("/run/gms-dev{device}.sock", 3, 1) == "/run/gms-dev1.sock"
    assert socket_for("/run/gms.sock", 3, 1) == "/run/gms.sock"


def test_weightless_proposers_pass_and_draft_models_are_refused() -> None:
    for method in (None, "custom_class", "ngram", "suffix"):
        check_speculative(method, WORKER_CLS)  # LUMEN's draft-assist is custom_class
    for method in ("draft_model", "eagle3", "mtp"):
        with pytest.raises(ValueError, match=rf"method '{method}' loads draft weights"):
            check_speculative(method, WORKER_CLS)


def test_only_the_vllm_releases_read_against_are_accepted() -> None:
    check_vllm_version("0.32.0", WORKER_CLS)
    check_vllm_version("0.33.1", WORKER_CLS)
    for version in ("0.31.2", "0.34.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x and 0\.33\.x; this is"):
            check_vllm_version(version, WORKER_CLS)


def test_importing_the_modules_does_not_import_vllm() -> None:
    code = ("import sys, lumend.engine.vllm_gms_worker as m, lumend.engine.vllm_gms_cpu_worker; "
            "m.gms_engine_args('cpu', 's'); "
            "print(sorted(k for k in sys.modules if k == 'vllm' or k.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_vllm_resolves_both_worker_classes_and_the_loader() -> None:
    pytest.importorskip("vllm")
    code = """
import lumend.engine.vllm_gms_worker as m
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
gpu = resolve_obj_by_qualname(m.WORKER_CLS)
cpu = resolve_obj_by_qualname(m.CPU_WORKER_CLS)
assert issubclass(gpu, Worker) and gpu.__qualname__ == "LumenGmsWorker"
assert issubclass(cpu, CPUWorker) and cpu.__qualname__ == "LumenGmsCpuWorker"
for cls in (gpu, cpu):
    for name in ("init_device", "sleep", "wake_up", "reload_weights"):
        assert name in vars(cls), (cls, name)
try:
    get_model_loader(LoadConfig(load_format=m.LOAD_FORMAT))
except RuntimeError as exc:
    print("refused:", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"refused: the {LOAD_FORMAT} loader runs only inside a LUMEN GMS worker" in out.stdout


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


def session(sock: Path | str, platform: Platform | None = None,
            timeout_s: float = 2.0) -> GmsWeights:
    return GmsWeights(socket=str(sock), timeout_s=timeout_s, original_format="auto",
                      worker_cls=CPU_WORKER_CLS,
                      make_platform=(lambda: platform) if platform else cpu_platform)


def commit_one_tensor(gms: GmsProcess, value: float, size: int = 4096) -> None:
    """A writer publishes one float32 tensor filled with `value` and leaves."""
    with gms.client() as writer:
        writer.hello("writer")
        alloc, _ = writer.allocate("weights", size)
        base = host_tensor_base(writer.map_fixed(alloc))
        base.view(torch.float32).fill_(value)
        writer.put_tensor(TensorMeta(name="w", allocation=alloc, offset=0,
                                     shape=[size // 4], dtype="float32"))
        writer.commit()


def test_a_gms_of_the_other_backend_is_refused_naming_the_fix(gms: GmsProcess) -> None:
    commit_one_tensor(gms, 1.0)
    gpu_like = Platform(name="cuda", backend="cuda", device=torch.device("cpu"),
                        map=lambda c, a: c.map_fixed(a), base=host_tensor_base,
                        synchronize=lambda: None, release_cached=lambda: None,
                        processing=nullcontext)
    weights = session(gms.socket, gpu_like)
    with pytest.raises(RuntimeError, match=r"runs the host backend; .* maps the cuda backend: "
                                           r"start it with .*--backend cuda"):
        weights.connect("reader")
    assert weights.client is None


def test_no_gms_server_is_a_clear_error_after_the_timeout(tmp_path: Path) -> None:
    weights = session(tmp_path / "nobody.sock", timeout_s=0.5)
    with pytest.raises(GmsUnavailable, match=r"no GMS server answered at .*nobody\.sock for "
                                             r"0 s .*python -m lumend\.gms\.server"):
        weights.connect("reader")
    with pytest.raises(GmsUnavailable, match=r"nobody\.sock .*--backend host\|cuda"):
        committed_weight_bytes(str(tmp_path / "nobody.sock"), timeout_s=0.3)


def test_wake_refuses_a_layout_that_changed_while_asleep_and_maps_nothing(
        tmp_path: Path) -> None:
    from lumenctl.localcluster import stop_process

    gms = start_gms(tmp_path)
    try:
        commit_one_tensor(gms, 1.0)
        weights = session(gms.socket)
        assert weights.connect("reader") == "reader"
        _, tensors, weights.layout_hash = weights.client.layout()
        view = weights.base_for(tensors[0].allocation).view(torch.float32)
        assert float(view[0]) == 1.0
        weights.unmap()  # sleep
        stop_process(gms.proc)  # GMS dies...
        with pytest.raises(GmsUnavailable):
            weights.remap()  # ...waking now is a clear error, not a silent weight
        gms = start_gms(tmp_path)  # ...and a new one holds other weights
        commit_one_tensor(gms, 2.0, size=8192)
        with pytest.raises(LayoutMismatch, match="changed while this engine slept"):
            weights.remap()
        assert not weights.mapped and weights.client is None
        assert gms.stats()["readers"] == 0  # it left again
    finally:
        stop_process(gms.proc)
