"""LUMEN's prepared device check: what the GPU path relies on, measured on one GPU.

    python bench/gpu/device_check.py --out result.json [--device 0] [--step NAME ...]

Torch and cuda-python only (no vLLM, no lumend dependencies beyond lumend/gms/cuda_vmm.py
and lumend/engine/kv_pages.py, which need nothing else). Each step runs in a process of its
own with its own timeout, so one fault (a step meant to fault included) hides none of the
others; the whole check stays under 5 minutes. The JSON names every step's status (passed,
failed, crashed, timed_out, skipped) and its measurements.

  a context       a fresh process without a CUDA context maps GMS memory (cuda_vmm makes a
                  context current; whether the driver needs one is recorded)
  b read_only     a writer's write lands; a reader's write to its read-only mapping faults
                  (its process dies or gets a CUDA error) and changes nothing
  c remap_graph   a captured CUDA graph reading weights at a GMS address gives the same
                  output after unmap + remap at that address, both for a remap of the
                  memory GMS still holds and for memory released and re-created; released,
                  the memory is free (cuMemGetInfo)
  d accounting    mapping a 1 GiB GMS allocation leaves a reader's free memory unchanged
  e release       seconds until the driver gives back 40 GiB after SIGKILL of the process
                  holding it (sizes the shadow's wake retry)
  f publish_peak  the writer's device memory peak while publishing 10 GiB of weights
                  through lumend.gms.weights.publish (or its torch-only equivalent when
                  msgspec is absent: the JSON says which)
  g page_copy     LumenConnector's page copies: old (pageable, per block, per layer) against
                  new (pinned staging, side stream, batched), blocks/s at Llama-3-70B TP4

Exit status: 0 every step passed, 1 a step failed, crashed or timed out, 2 no CUDA here (the
JSON says why; every step is reported skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOTAL_BUDGET_S = 290.0  # the probe and every step together
RESULT = "RESULT "  # the prefix of the one line a child reports on stdout
GIB = 1 << 30
MIB = 1 << 20


# -- what every child shares -----------------------------------------------------------


def report(**fields: Any) -> None:
    print(RESULT + json.dumps(fields), flush=True)


def vmm(ordinal: int) -> Any:
    from lumend.gms.cuda_vmm import CudaDevice

    return CudaDevice(ordinal)


def round_up(size: int, granularity: int) -> int:
    return -(-size // granularity) * granularity


def tensor_at(va: int, nbytes: int, ordinal: int) -> Any:
    """A flat uint8 CUDA tensor over raw device memory (what lumend.gms.weights.device_base
    makes, without importing lumend.gms.weights and its msgspec)."""
    import torch

    class _Array:
        def __init__(self) -> None:
            self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                             "data": (va, False), "version": 3,
                                             "strides": None}

    return torch.as_tensor(_Array(), device=torch.device("cuda", ordinal))


def digest(tensor: Any) -> str:
    import torch
    from page_copy import host_bytes

    flat = tensor.detach().contiguous().view(-1).view(torch.uint8).cpu()
    return hashlib.sha256(host_bytes(flat)).hexdigest()[:16]


def free_bytes(ordinal: int) -> int:
    import torch

    return int(torch.cuda.mem_get_info(ordinal)[0])


def child(args: list[str], timeout_s: float, pass_fds: tuple[int, ...] = (),
          own_group: bool = False) -> dict[str, Any]:
    """Run this script in one role in a new process; its RESULT, or how it ended.
    `own_group` (steps): a timeout kills the step and every process it started (a holder
    of 40 GiB must not outlive its step)."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, pass_fds=pass_fds,
                            start_new_session=own_group)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        if own_group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        stdout, stderr = proc.communicate()
        return {"ended": "timed_out", "after_s": round(timeout_s, 1),
                **_last_result(stdout), "stderr_tail": _tail(stderr)}
    if own_group:  # whatever the step left running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    code = proc.returncode
    return {**_last_result(stdout), "ended": "exited" if code >= 0 else
            f"killed by signal {-code}", "returncode": code,
            "seconds": round(time.monotonic() - started, 2),
            **({"stderr_tail": _tail(stderr)} if code else {})}


def _last_result(stdout: str | None) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for line in (stdout or "").splitlines():
        if line.startswith(RESULT):
            result = json.loads(line[len(RESULT):])
    return result


def _tail(text: str | bytes | None, lines: int = 8) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join(text.strip().splitlines()[-lines:])


# -- a: a fresh process maps GMS memory -------------------------------------------------


def step_context(o: argparse.Namespace) -> dict[str, Any]:
    device = vmm(o.device)
    size = round_up(64 * MIB, device.granularity())
    handle = device.create(size)
    fd = device.export_fd(handle)
    try:
        mapper = child(["--role", "fresh_mapper", "--device", str(o.device), "--fd", str(fd),
                        "--size", str(size)], 60, pass_fds=(fd,))
    finally:
        os.close(fd)
        device.release(handle)
    ok = mapper.get("read_back_ok") is True and mapper.get("context_before") == "none"
    return {"status": "passed" if ok else "failed", "mapper": mapper}


def role_fresh_mapper(o: argparse.Namespace) -> None:
    from lumend.gms.cuda_vmm import DeviceMapping

    device = vmm(o.device)
    cu = device.cu
    err, current = cu.cuCtxGetCurrent()
    context_before = "none" if current is None or int(current) == 0 else "present"
    # What the driver says to a reserve with no context current (cuda_vmm never does it).
    err, va = cu.cuMemAddressReserve(o.size, device.granularity(), 0, 0)
    raw_reserve = getattr(err, "name", str(err))
    if err == cu.CUresult.CUDA_SUCCESS:
        cu.cuMemAddressFree(va, o.size)
    mapping = DeviceMapping(device, 0, o.size, "check", o.fd, writable=True)
    data = hashlib.shake_256(b"lumen").digest(4096)
    mapping.write(0, data)
    report(context_before=context_before, reserve_without_context=raw_reserve,
           read_back_ok=mapping.read(0, len(data)) == data)
    mapping.close()


# -- b: a reader's write faults, the writer's lands -------------------------------------


def step_read_only(o: argparse.Namespace) -> dict[str, Any]:
    device = vmm(o.device)
    size = round_up(64 * MIB, device.granularity())
    handle = device.create(size)
    fd = device.export_fd(handle)
    common = ["--device", str(o.device), "--fd", str(fd), "--size", str(size)]
    try:
        writer = child(["--role", "mapper", "--access", "write", *common], 90, (fd,))
        reader = child(["--role", "mapper", "--access", "write_read_only", *common], 90, (fd,))
        after = child(["--role", "mapper", "--access", "read", *common], 90, (fd,))
    finally:
        os.close(fd)
        device.release(handle)
    written = writer.get("digest")
    reader_faulted = reader.get("write") != "completed"  # died, or a CUDA error raised
    ok = (writer.get("write") == "completed" and written is not None
          and reader.get("digest_before_write") == written and reader_faulted
          and after.get("digest") == written)
    return {"status": "passed" if ok else "failed", "writer": writer, "reader": reader,
            "reader_faulted": reader_faulted, "unchanged_after": after.get("digest") == written,
            "verify": after}


def role_mapper(o: argparse.Namespace) -> None:
    import torch

    from lumend.gms.cuda_vmm import DeviceMapping

    torch.cuda.init()  # type: ignore[no-untyped-call]
    torch.zeros(1, device=f"cuda:{o.device}")  # PyTorch's context first, as in an engine
    device = vmm(o.device)
    writable = o.access == "write"
    mapping = DeviceMapping(device, 0, o.size, "check", o.fd, writable=writable)
    base = tensor_at(mapping.va, o.size, o.device)
    if o.access == "write":
        generator = torch.Generator(device=f"cuda:{o.device}").manual_seed(11)
        base.copy_(torch.randint(0, 256, (o.size,), dtype=torch.uint8,
                                 device=f"cuda:{o.device}", generator=generator))
        torch.cuda.synchronize()
        report(write="completed", digest=digest(base))
        return
    before = digest(base)
    if o.access == "read":
        report(digest=before)
        return
    print(RESULT + json.dumps({"digest_before_write": before, "write": "attempted"}),
          flush=True)
    try:
        base[:4096].fill_(7)  # what vLLM's fill_(1.0) on a shared buffer would do
        torch.cuda.synchronize()
    except RuntimeError as exc:
        report(digest_before_write=before, write="cuda_error", error=str(exc)[:300])
        os._exit(0)  # the context is unusable after a fault: leave without cleanup
    report(digest_before_write=before, write="completed", digest_after=digest(base))


# -- c: unmap + remap at one address keeps a CUDA graph valid ---------------------------


def step_remap_graph(o: argparse.Namespace) -> dict[str, Any]:
    import torch

    dev = f"cuda:{o.device}"
    torch.zeros(1, device=dev)
    device = vmm(o.device)
    n = 2048
    # Larger than the weights so that the freed memory stands out of cuMemGetInfo's noise.
    size = round_up(max(n * n * 4, 256 * MIB), device.granularity())
    handle = device.create(size)
    va = device.reserve(size)
    device.map(va, size, handle)
    device.set_access(va, size, writable=True)
    weights = tensor_at(va, size, o.device)[:n * n * 4].view(torch.float32).view(n, n)
    generator = torch.Generator(device="cpu").manual_seed(5)
    host_copy = torch.randn(n, n, generator=generator)
    weights.copy_(host_copy)
    x = torch.randn(64, n, generator=generator).to(dev)
    y = torch.empty(64, n, device=dev)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            torch.matmul(x, weights, out=y)  # warm-up before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.matmul(x, weights, out=y)

    def run() -> str:
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        return digest(y)

    first = run()
    # 1: GMS keeps the memory (another engine's weights); this process unmaps and remaps.
    held_free = free_bytes(o.device)
    device.unmap(va, size)
    unmapped_free_held = free_bytes(o.device)
    device.map(va, size, handle)
    device.set_access(va, size, writable=True)
    after_remap = run()
    # 2: the memory is released while unmapped (sleep), re-created and refilled (wake).
    device.unmap(va, size)
    device.release(handle)
    torch.cuda.synchronize()
    released_free = free_bytes(o.device)
    handle = device.create(size)
    device.map(va, size, handle)
    device.set_access(va, size, writable=True)
    weights.copy_(host_copy)
    after_recreate = run()
    weights.mul_(2)  # control: the graph reads what is at that address now
    doubled = run()
    device.unmap(va, size)
    device.release(handle)
    device.free_address(va, size)
    freed = released_free - held_free
    ok = (first == after_remap == after_recreate != doubled and freed >= size * 0.9
          and abs(unmapped_free_held - held_free) < size // 2)
    return {"status": "passed" if ok else "failed", "graph_output": first,
            "after_remap_same_memory": after_remap, "after_release_and_recreate":
            after_recreate, "with_other_weights_at_the_address": doubled,
            "allocation_bytes": size,
            "freed_while_released_bytes": freed,
            "free_change_unmapped_but_held_bytes": unmapped_free_held - held_free}


# -- d: a reader's free memory is unchanged by mapping ----------------------------------


def step_accounting(o: argparse.Namespace) -> dict[str, Any]:
    device = vmm(o.device)
    size = round_up(GIB, device.granularity())
    handle = device.create(size)
    fd = device.export_fd(handle)
    try:
        reader = child(["--role", "accounting_reader", "--device", str(o.device), "--fd",
                        str(fd), "--size", str(size)], 90, (fd,))
    finally:
        os.close(fd)
        device.release(handle)
    change = reader.get("free_change_bytes")
    ok = isinstance(change, int) and abs(change) < 64 * MIB
    return {"status": "passed" if ok else "failed", "allocation_bytes": size,
            "reader": reader}


def role_accounting_reader(o: argparse.Namespace) -> None:
    import torch

    from lumend.gms.cuda_vmm import DeviceMapping

    torch.zeros(1, device=f"cuda:{o.device}")
    device = vmm(o.device)
    before = free_bytes(o.device)
    mapping = DeviceMapping(device, 0, o.size, "check", o.fd, writable=False)
    after = free_bytes(o.device)
    torch_reserved = int(torch.cuda.memory_reserved(o.device))
    report(free_before_bytes=before, free_after_bytes=after,
           free_change_bytes=after - before, torch_reserved_bytes=torch_reserved)
    mapping.close()


# -- e: how long the driver takes to give memory back after SIGKILL ---------------------


def step_release(o: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.zeros(1, device=f"cuda:{o.device}")
    total_free = free_bytes(o.device)
    nbytes = min(int(o.release_gib * GIB), int(total_free * 0.8))
    holder = subprocess.Popen(
        [sys.executable, __file__, "--role", "holder", "--device", str(o.device),
         "--size", str(nbytes)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()  # "held" once the memory is allocated
        if not line.startswith(RESULT):
            return {"status": "failed", "reason": "the holder did not allocate",
                    "line": line}
        held_free = free_bytes(o.device)
        killed_at = time.monotonic()
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        reaped_s = time.monotonic() - killed_at
        freed_s = None
        while time.monotonic() - killed_at < 60:
            if free_bytes(o.device) >= held_free + nbytes * 0.95:
                freed_s = time.monotonic() - killed_at
                break
            time.sleep(0.002)
        # A wake that allocates as soon as the memory shows free (what a retry waits for).
        allocated_s = None
        while time.monotonic() - killed_at < 60:
            try:
                block = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{o.device}")
                allocated_s = time.monotonic() - killed_at
                del block
                break
            except torch.cuda.OutOfMemoryError:
                time.sleep(0.005)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    ok = freed_s is not None and allocated_s is not None
    return {"status": "passed" if ok else "failed", "held_bytes": nbytes,
            "asked_gib": o.release_gib, "process_reaped_s": round(reaped_s, 4),
            "memory_free_s": None if freed_s is None else round(freed_s, 4),
            "reallocated_s": None if allocated_s is None else round(allocated_s, 4)}


def role_holder(o: argparse.Namespace) -> None:
    import torch

    block = torch.empty(o.size, dtype=torch.uint8, device=f"cuda:{o.device}")
    block.fill_(1)
    torch.cuda.synchronize()
    report(held=o.size)
    time.sleep(600)


# -- f: the writer's peak while publishing ----------------------------------------------


class _VmmClient:
    """What lumend.gms.weights.publish needs of a GMS writer, over cuda_vmm in-process:
    allocations are created, mapped read-write and kept (the server's part is local)."""

    def __init__(self, device: Any, ordinal: int) -> None:
        self.device = device
        self.ordinal = ordinal
        self.allocations: dict[int, tuple[int, int, int]] = {}  # id -> (handle, va, size)
        self.tensors: list[Any] = []

    def allocate(self, tag: str, size: int) -> tuple[int, int]:
        size = round_up(size, self.device.granularity())
        handle = self.device.create(size)
        va = self.device.reserve(size)
        self.device.map(va, size, handle)
        self.device.set_access(va, size, writable=True)
        allocation = len(self.allocations) + 1
        self.allocations[allocation] = (handle, va, size)
        return allocation, size

    def base_for(self, allocation: int) -> Any:
        _, va, size = self.allocations[allocation]
        return tensor_at(va, size, self.ordinal)

    def put_tensor(self, meta: Any) -> None:
        self.tensors.append(meta)


class _PeakSampler:
    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self.lowest_free = free_bytes(ordinal)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.lowest_free = min(self.lowest_free, free_bytes(self.ordinal))
            time.sleep(0.001)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.lowest_free


def _publish_torch_only(client: _VmmClient, module: Any, chunk_bytes: int,
                        after_chunk: Callable[[], None]) -> int:
    """lumend.gms.weights.publish's algorithm without its imports: one chunk at a time,
    parameters re-pointed at the shared copy and their originals dropped before the next
    chunk is allocated."""
    import torch

    params = list(module.named_parameters())
    total = 0
    while params:
        chunk: list[str] = []
        size = 0
        while params and (not chunk or size + params[0][1].nbytes <= chunk_bytes):
            name, param = params.pop(0)
            chunk.append(name)
            size += round_up(param.nbytes, 256)
        allocation, _ = client.allocate("weights", size)
        base = client.base_for(allocation)
        offset = 0
        for name in chunk:
            param = module.get_parameter(name)
            shared = base[offset:offset + param.nbytes].view(param.dtype).view(param.shape)
            with torch.no_grad():
                shared.copy_(param)
            param.data = shared
            offset += round_up(param.nbytes, 256)
            total += shared.nbytes
        del base, param
        after_chunk()
    return total


def step_publish_peak(o: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch import nn

    dev = f"cuda:{o.device}"
    torch.zeros(1, device=dev)
    device = vmm(o.device)
    baseline = free_bytes(o.device)
    per = 256 * MIB
    count = max(1, int(o.publish_gib * GIB) // per)
    module = nn.Module()
    for i in range(count):
        module.register_parameter(f"w{i}", nn.Parameter(
            torch.empty(per // 2, dtype=torch.bfloat16, device=dev), requires_grad=False))
    torch.cuda.synchronize()
    weights_bytes = baseline - free_bytes(o.device)
    client = _VmmClient(device, o.device)
    sampler = _PeakSampler(o.device)
    try:
        from lumend.gms import weights as gms_weights

        path = "lumend.gms.weights.publish"
        chunk_bytes = gms_weights.CHUNK_BYTES
        published = gms_weights.publish(client, module, client.base_for,
                                        after_chunk=torch.cuda.empty_cache)
    except ImportError as exc:
        path = f"torch-only equivalent ({exc.name or exc} not importable here)"
        chunk_bytes = GIB
        published = _publish_torch_only(client, module, chunk_bytes, torch.cuda.empty_cache)
    torch.cuda.synchronize()
    lowest_free = sampler.stop()
    peak = baseline - lowest_free
    after = baseline - free_bytes(o.device)
    still_private = sum(p.nbytes for p in module.parameters()
                        if not _in_allocations(p.data_ptr(), client))
    ok = peak <= weights_bytes + 2 * chunk_bytes + 512 * MIB and still_private == 0
    return {"status": "passed" if ok else "failed", "path": path,
            "weights_bytes": weights_bytes, "published_bytes": published,
            "chunk_bytes": chunk_bytes, "peak_bytes": peak,
            "peak_over_weights": round(peak / max(1, weights_bytes), 3),
            "after_bytes": after, "params_still_private_bytes": still_private}


def _in_allocations(ptr: int, client: _VmmClient) -> bool:
    return any(va <= ptr < va + size for _, va, size in client.allocations.values())


# -- g: the connector's page copies ------------------------------------------------------


def step_page_copy(o: argparse.Namespace) -> dict[str, Any]:
    import torch
    from page_copy import LLAMA70B_TP4, measure

    result = measure(LLAMA70B_TP4, torch.device("cuda", o.device), blocks=64, repeats=3)
    ok = result["pages_identical_old_new"] and all(result["restored_exactly"].values())
    return {"status": "passed" if ok else "failed", **result}


# -- self-test steps (no GPU: the isolation itself) -------------------------------------


def step_self_test_ok(o: argparse.Namespace) -> dict[str, Any]:
    return {"status": "passed"}


def step_self_test_crash(o: argparse.Namespace) -> dict[str, Any]:
    os.kill(os.getpid(), signal.SIGSEGV)  # as a driver fault would end a process
    return {"status": "passed"}


def step_self_test_hang(o: argparse.Namespace) -> dict[str, Any]:
    time.sleep(3600)
    return {"status": "passed"}


# name -> (function, timeout in seconds, needs cuda-python)
STEPS: dict[str, tuple[Callable[[argparse.Namespace], dict[str, Any]], float, bool]] = {
    "a_context": (step_context, 60, True),
    "b_read_only": (step_read_only, 120, True),
    "c_remap_graph": (step_remap_graph, 60, True),
    "d_accounting": (step_accounting, 60, True),
    "e_release": (step_release, 90, False),
    "f_publish_peak": (step_publish_peak, 120, True),
    "g_page_copy": (step_page_copy, 90, False),
}
SELF_TEST_STEPS = {
    "self_test_ok": (step_self_test_ok, 30.0, False),
    "self_test_crash": (step_self_test_crash, 30.0, False),
    "self_test_hang": (step_self_test_hang, 3.0, False),
}
ROLES: dict[str, Callable[[argparse.Namespace], None]] = {
    "fresh_mapper": role_fresh_mapper, "mapper": role_mapper,
    "accounting_reader": role_accounting_reader, "holder": role_holder,
}


# -- the parent: probe, then one process per step ---------------------------------------


def probe() -> dict[str, Any]:
    """What this machine has, found in a child (the parent never creates a CUDA context)."""
    found = child(["--role-probe"], 45)
    found.pop("ended", None)
    return found


def role_probe() -> None:
    info: dict[str, Any] = {"python": platform.python_version()}
    try:
        import torch
    except ImportError as exc:
        report(**info, cuda=False, reason=f"torch is not installed ({exc})")
        return
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    if not torch.cuda.is_available():
        report(**info, cuda=False, reason="torch sees no CUDA device (torch.cuda."
               "is_available() is False: a CPU build of torch, no driver, or no GPU)")
        return
    info.update(cuda=True, devices=[torch.cuda.get_device_name(i)
                                    for i in range(torch.cuda.device_count())])
    try:
        from lumend.gms.cuda_vmm import driver

        cu = driver()
        _, version = cu.cuDriverGetVersion()
        info["driver_cuda_version"] = int(version)
        info["cuda_python"] = True
    except Exception as exc:  # CudaUnavailable names the fix; anything else is a finding
        info["cuda_python"] = False
        info["cuda_python_reason"] = str(exc)
    report(**info)


def run_steps(names: list[str], o: argparse.Namespace, machine: dict[str, Any],
              deadline: float) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    table = {**STEPS, **SELF_TEST_STEPS}
    for name in names:
        _, timeout_s, needs_vmm = table[name]
        is_self_test = name in SELF_TEST_STEPS
        if not machine.get("cuda") and not is_self_test:
            results[name] = {"status": "skipped", "reason": f"no CUDA: {machine.get('reason')}"}
            continue
        if needs_vmm and not machine.get("cuda_python") and not is_self_test:
            results[name] = {"status": "skipped",
                             "reason": f"cuda-python: {machine.get('cuda_python_reason')}"}
            continue
        left = deadline - time.monotonic()
        if left < 5:
            results[name] = {"status": "skipped", "reason": "the check's 5-minute budget is "
                             "spent"}
            continue
        ran = child(["--run-step", name, "--device", str(o.device), "--release-gib",
                     str(o.release_gib), "--publish-gib", str(o.publish_gib)],
                    min(timeout_s, left), own_group=True)
        if ran["ended"] == "timed_out":
            ran["status"] = "timed_out"
        elif "status" not in ran:
            ran["status"] = "crashed"  # died before it could report
        results[name] = ran
        print(f"  {name:<16} {ran['status']:<10} {ran.get('seconds', ran.get('after_s', ''))}"
              " s", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="where the JSON goes (default: $OUT/"
                        "device_check.json when $OUT is set, else stdout only)")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--step", action="append", choices=sorted(STEPS),
                        help="run only these steps (repeatable)")
    parser.add_argument("--release-gib", type=float, default=40.0)
    parser.add_argument("--publish-gib", type=float, default=10.0)
    parser.add_argument("--self-test", action="store_true", help=argparse.SUPPRESS)
    # child modes
    parser.add_argument("--run-step", help=argparse.SUPPRESS)
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--role-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--access", help=argparse.SUPPRESS)
    o = parser.parse_args()

    if o.role_probe:
        role_probe()
        return 0
    if o.role:
        ROLES[o.role](o)
        return 0
    if o.run_step:
        function = {**STEPS, **SELF_TEST_STEPS}[o.run_step][0]
        try:
            result = function(o)
        except Exception as exc:  # a step that raises failed; one that dies crashed
            result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:1000]}
        report(**result)
        return 0

    started = time.time()
    deadline = time.monotonic() + TOTAL_BUDGET_S
    machine = probe()
    names = list(o.step or STEPS) + (list(SELF_TEST_STEPS) if o.self_test else [])
    print(f"LUMEN device check: {machine.get('devices') or machine.get('reason')}", flush=True)
    steps = run_steps(names, o, machine, deadline)
    statuses = [s["status"] for s in steps.values()]
    real = [steps[n]["status"] for n in steps if n in STEPS]
    if not machine.get("cuda"):
        code = 2
    elif all(s in ("passed", "skipped") for s in real) and "passed" in real:
        code = 0
    else:
        code = 1
    summary = {status: statuses.count(status) for status in sorted(set(statuses))}
    out = {"check": "lumen-device-check", "version": 1, "started_at": started,
           "seconds": round(time.time() - started, 1), "host": platform.node(),
           "machine": machine, "steps": steps, "summary": summary, "exit_code": code}
    text = json.dumps(out, indent=2, sort_keys=True)
    target = o.out or (Path(os.environ["OUT"]) / "device_check.json"
                       if os.environ.get("OUT") else None)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n")
        print(f"wrote {target}: {summary}, exit {code}")
    else:
        print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
