"""GPU check of GMS's cuda backend: weights in device memory outlive the process that
loaded them. Prints a table; exits 0 when every check passed, 1 when one failed, 2 when
this machine has no usable CUDA (cuda-python or driver missing), 3 when a Python package
LUMEN needs is missing.

Checks, each with real processes on one GPU:
  writer loads      a writer process fills a GMS allocation (cuMemCreate, exported as a
                    POSIX fd) with a seeded pattern and commits
  reader maps       a second process maps it read-only and reads identical bytes (sha256)
  torch view        the reader reads the mapping as a CUDA tensor (the vLLM worker's path)
  module publish    the writer publishes a small torch module; the reader materialises a
                    meta-device copy on the mapped tensors and computes the same output
  read-only         a read-only reader's write attempt fails and changes nothing
  writer SIGKILLed  the reader still reads the same bytes and output
  new reader        a reader that starts after the kill reads them too

    python bench/gpu/gms_check.py [--device 0] [--mib 64]

On the lent H200 machine (no package index there): msgspec is not in its image, so carry
it as a wheel. Here: `echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps
--only-binary=:all: --python-version 3.12 --implementation cp --platform
manylinux_2_17_x86_64 -d .whl msgspec==0.23.0`; there (carry `.whl`):
`python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
PYTHONPATH=/tmp/site:. python3 bench/gpu/gms_check.py`.

A vLLM sleep/wake check is not part of this script: vLLM is not in that machine's image
and its wheels exceed what a device call can carry.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SEED = 20261117


def pattern(nbytes: int) -> bytes:
    return hashlib.shake_256(SEED.to_bytes(8, "big")).digest(nbytes)


# -- child processes (the same file, one role each) ---------------------------------------


def _emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _tiny_module() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 32))
    model.register_buffer("scale", torch.linspace(0.5, 1.5, 32))
    return model


def _module_output(model: Any, device: Any) -> str:
    import torch

    torch.manual_seed(1)
    x = torch.randn(4, 64).to(device)
    with torch.no_grad():
        y = (model(x) * model.scale).float().cpu()
    return hashlib.sha256(y.numpy().tobytes()).hexdigest()


def role_writer(args: argparse.Namespace) -> None:
    from lumend.gms.client import GmsClient
    from lumend.gms.cuda_vmm import CudaDevice
    from lumend.gms.protocol import TensorMeta

    device = CudaDevice(args.device)
    client = GmsClient(args.socket)
    assert client.hello("writer") == "writer", "GMS was not empty"
    data = pattern(args.mib << 20)
    alloc, _size = client.allocate("weights", len(data))
    mapping = client.map_device(alloc, device)
    mapping.write(0, data)
    client.put_tensor(TensorMeta(name="blob", allocation=alloc, offset=0, shape=[len(data)],
                                 dtype="uint8"))
    module_sha = None
    if importlib.util.find_spec("torch") is not None:
        import torch

        from lumend.gms.weights import device_base, publish

        model = _tiny_module().to(torch.device("cuda", args.device))
        expected = _module_output(model, torch.device("cuda", args.device))
        mappings = []

        def base_for(allocation: int) -> Any:
            m = client.map_device(allocation, device)
            mappings.append(m)
            return device_base(m)

        publish(client, model, base_for)
        torch.cuda.synchronize()
        module_sha = _module_output(model, torch.device("cuda", args.device))
        assert module_sha == expected, "the writer's output changed after publishing"
    layout = client.commit()
    _emit(role="writer", sha=hashlib.sha256(mapping.read(0, len(data))).hexdigest(),
          module_sha=module_sha, layout=layout, pid=os.getpid())
    time.sleep(3600)  # hold the session until SIGKILLed


def role_reader(args: argparse.Namespace) -> None:
    from lumend.gms.client import GmsClient
    from lumend.gms.cuda_vmm import CudaDevice

    device = CudaDevice(args.device)
    client = GmsClient(args.socket)
    assert client.hello("reader", timeout_s=30) == "reader"
    _, tensors, layout = client.layout()
    blob = next(t for t in tensors if t.name == "blob")
    mapping = client.map_device(blob.allocation, device)
    has_torch = importlib.util.find_spec("torch") is not None
    model = None
    if has_torch:
        import torch

        from lumend.gms.weights import device_base, materialize

        with torch.device("meta"):
            model = _tiny_module()
        mappings = []

        def base_for(allocation: int) -> Any:
            m = client.map_device(allocation, device)
            mappings.append(m)
            return device_base(m)

        materialize(model, [t for t in tensors if t.name != "blob"], base_for)

    def report() -> None:
        data = mapping.read(0, blob.shape[0])
        fields: dict[str, Any] = {"role": "reader", "sha": hashlib.sha256(data).hexdigest(),
                                  "layout": layout, "writable": mapping.writable}
        if has_torch:
            import torch

            from lumend.gms.weights import device_base

            view = device_base(mapping)[: blob.shape[0]]
            fields["torch_sum"] = int(view.to(torch.int64).sum().item())
            fields["host_sum"] = sum(data)
            fields["module_sha"] = _module_output(model, torch.device("cuda", args.device))
        _emit(**fields)

    report()
    for line in sys.stdin:  # one report per line the parent sends
        if line.strip() == "read":
            report()


def role_write_probe(args: argparse.Namespace) -> None:
    from lumend.gms.client import GmsClient
    from lumend.gms.cuda_vmm import CudaDevice

    device = CudaDevice(args.device)
    client = GmsClient(args.socket)
    assert client.hello("reader", timeout_s=30) == "reader"
    _, tensors, _ = client.layout()
    blob = next(t for t in tensors if t.name == "blob")
    mapping = client.map_device(blob.allocation, device)
    _emit(role="probe", mapped=True)
    try:
        mapping.write(0, b"\x00" * 4096)
    except Exception as exc:  # the expected outcome: the driver refuses the write
        _emit(role="probe", refused=True, error=f"{type(exc).__name__}: {exc}")
        return
    _emit(role="probe", refused=False, error="")


# -- the orchestrator -----------------------------------------------------------------------


class Child:
    def __init__(self, role: str, args: argparse.Namespace, sock: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--role", role, "--socket", sock,
             "--device", str(args.device), "--mib", str(args.mib)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def report(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # children answer or exit; SIGALRM bounds the run
        if not line:
            raise RuntimeError(f"child exited with {self.proc.wait()}")
        return dict(json.loads(line))

    def ask(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("read\n")
        self.proc.stdin.flush()
        return self.report()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def preflight(device: int) -> None:
    from lumend.gms.cuda_vmm import CudaDevice, CudaUnavailable

    try:
        CudaDevice(device)
    except CudaUnavailable as exc:
        print(f"gms_check: no usable CUDA here, nothing checked: {exc}", file=sys.stderr)
        sys.exit(2)
    missing = [m for m in ("msgspec",) if importlib.util.find_spec(m) is None]
    if missing:
        print(f"gms_check: Python package(s) {', '.join(missing)} missing; carry them as "
              "wheels (see this script's docstring)", file=sys.stderr)
        sys.exit(3)


def _timed_out(signum: int, frame: Any) -> None:
    raise TimeoutError("the check ran past its time limit (--timeout)")


def run_checks(args: argparse.Namespace) -> list[tuple[str, bool, str, float]]:
    rows: list[tuple[str, bool, str, float]] = []
    children: list[Child] = []
    tmp = Path(tempfile.mkdtemp(prefix="gms-check-"))
    sock = str(tmp / "gms.sock")
    log = (tmp / "gms.log").open("wb")
    server = subprocess.Popen([sys.executable, "-m", "lumend.gms.server", "--socket", sock,
                               "--backend", "cuda", "--device", str(args.device)],
                              stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def check(name: str, ok: bool, detail: str, started: float) -> bool:
        rows.append((name, ok, detail, time.monotonic() - started))
        return ok

    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"GMS server did not start: {(tmp / 'gms.log').read_text()}")
            time.sleep(0.05)

        t = time.monotonic()
        writer = Child("writer", args, sock)
        children.append(writer)
        w = writer.report()
        check("writer loads", True, f"{args.mib} MiB, sha {w['sha'][:12]}", t)

        t = time.monotonic()
        reader = Child("reader", args, sock)
        children.append(reader)
        r = reader.report()
        check("reader maps", r["sha"] == w["sha"] and not r["writable"],
              f"read-only={not r['writable']}, sha {r['sha'][:12]}", t)
        if "torch_sum" in r:
            check("torch view", r["torch_sum"] == r["host_sum"],
                  f"sum {r['torch_sum']} (host {r['host_sum']})", t)
            check("module publish", r["module_sha"] == w["module_sha"],
                  f"output sha {str(r['module_sha'])[:12]}", t)
        else:
            rows.append(("torch view", True, "SKIP: torch not installed", 0.0))

        t = time.monotonic()
        probe = Child("write-probe", args, sock)
        children.append(probe)
        mapped = probe.report()
        assert mapped.get("mapped"), f"the probe did not map: {mapped}"
        try:
            p = probe.report()
            refused, detail = bool(p["refused"]), p["error"][:60]
        except RuntimeError as exc:  # the probe died on its write: refused as well
            refused, detail = True, f"probe process died on its write ({exc})"
        after = reader.ask()
        check("read-only", refused and after["sha"] == w["sha"],
              f"write refused={refused}; {detail}", t)

        t = time.monotonic()
        writer.proc.send_signal(signal.SIGKILL)
        writer.proc.wait()
        r2 = reader.ask()
        check("writer SIGKILLed", r2["sha"] == w["sha"] and r2.get("module_sha") ==
              w["module_sha"], f"reader still reads sha {r2['sha'][:12]}", t)

        t = time.monotonic()
        late = Child("reader", args, sock)
        children.append(late)
        r3 = late.report()
        check("new reader", r3["sha"] == w["sha"] and r3.get("module_sha") ==
              w["module_sha"] and r3["layout"] == w["layout"],
              f"sha {r3['sha'][:12]}, same layout hash", t)
    except Exception as exc:
        rows.append(("(aborted)", False, f"{type(exc).__name__}: {exc}"[:100], 0.0))
    finally:
        for child in children:
            child.stop()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--mib", type=int, default=64, help="size of the checked blob")
    parser.add_argument("--timeout", type=int, default=240, help="seconds for all checks")
    parser.add_argument("--role", choices=["writer", "reader", "write-probe"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "writer":
        return role_writer(args)
    if args.role == "reader":
        return role_reader(args)
    if args.role == "write-probe":
        return role_write_probe(args)

    preflight(args.device)
    signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(args.timeout)
    started = time.monotonic()
    rows = run_checks(args)
    width = max(len(name) for name, *_ in rows)
    print(f"{'check':<{width}}  result  seconds  detail")
    for name, ok, detail, seconds in rows:
        print(f"{name:<{width}}  {'PASS' if ok else 'FAIL':<6}  {seconds:7.2f}  {detail}")
    failed = [name for name, ok, *_ in rows if not ok]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed "
          f"({time.monotonic() - started:.1f} s)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
