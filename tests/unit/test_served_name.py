"""A worker's served name: vLLM's --served-model-name in its args, else its model. The
cluster routes, lists and matches by it; the engine still loads `model` (issue 17)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lumend.config import (
    NodeConfig,
    WorkerConfig,
    parse_config,
    served_model_names,
    served_name_warnings,
)
from lumend.engine.adapter import VllmAdapter
from lumend.failover.supervisor import WorkerSupervisor

from .test_config import config_text, problem_at, problems_of, worker

QWEN = "/models/Qwen3-32B"


def vllm(name: str = "w0", port: int = 8100, gpus: list[int] | None = None,
         **overrides: Any) -> dict[str, Any]:
    return worker(**{"name": name, "engine": "vllm", "model": QWEN, "gpus": gpus or [0],
                     "port": port, "shadows": 0, **overrides})


def only_worker(*args: str, model: str = QWEN) -> WorkerConfig:
    [w] = parse_config(config_text(workers=[vllm(args=list(args), model=model)])).workers
    return w


@pytest.mark.parametrize(("args", "names"), [
    (["--served-model-name", "qwen"], ("qwen",)),
    (["--served-model-name=qwen"], ("qwen",)),
    (["--served_model_name", "qwen"], ("qwen",)),  # vLLM reads _ as -
    (["--served-model-name", "qwen", "q", "--max-num-seqs", "8"], ("qwen", "q")),
    (["--served-model-name", "old", "--served-model-name", "new"], ("new",)),  # last wins
    (["--tensor-parallel-size", "1"], ()),
])
def test_served_model_names_are_read_as_vllm_reads_them(args: list[str],
                                                         names: tuple[str, ...]) -> None:
    assert served_model_names(args) == names


def test_served_name_from_either_arg_form_and_the_model_is_still_loaded() -> None:
    spaced = only_worker("--served-model-name", "qwen", "--max-num-seqs", "8")
    assert spaced.served_name == "qwen" and spaced.model == QWEN
    assert only_worker("--served-model-name=qwen").served_name == "qwen"
    plain = only_worker("--max-num-seqs", "8")
    assert plain.served_name == QWEN and plain.served_names == (QWEN,)


def test_a_sim_worker_serves_under_a_name_of_its_own() -> None:
    [w] = parse_config(config_text(workers=[worker(args=["--served-model-name", "short"])]
                                   )).workers
    assert (w.model, w.served_name) == ("sim-small", "short")


def test_the_worker_record_carries_the_served_name(tmp_path: Path) -> None:
    """What the gateway routes by, /v1/models lists and the coordinator groups by."""
    w = only_worker("--served-model-name", "qwen")
    supervisor = WorkerSupervisor("n1", w, VllmAdapter(cuda=False),
                                  runtime_dir=tmp_path / "run", log_dir=tmp_path / "logs")
    assert supervisor.record().model == "qwen"
    assert supervisor.slots[0].spec.model == QWEN  # the engine loads the model


@pytest.mark.parametrize("args", [
    ["--served-model-name"],
    ["--served-model-name", "--max-num-seqs", "8"],
    ["--served-model-name="],
])
def test_a_served_model_name_without_a_name_is_an_error(args: list[str]) -> None:
    problem = problem_at(config_text(workers=[vllm(args=args)]), "workers[0].args")
    assert "needs a name after it" in problem.fix


def test_two_workers_serving_one_name_with_different_models_is_an_error() -> None:
    text = config_text(workers=[
        vllm("a", 8100, [0], args=["--served-model-name", "qwen"]),
        vllm("b", 8200, [1], model="/models/Qwen3-8B", args=["--served-model-name=qwen"]),
    ])
    [problem] = problems_of(text)
    assert problem.key == "workers[1].args"
    assert 'workers[1] "b"' in problem.fix and 'workers[0] "a"' in problem.fix
    assert "'/models/Qwen3-8B', not '/models/Qwen3-32B'" in problem.fix


def test_a_served_name_that_is_another_workers_model_collides_too() -> None:
    text = config_text(workers=[
        vllm("a", 8100, [0], model="qwen"),
        vllm("b", 8200, [1], args=["--served-model-name", "qwen"]),
    ])
    [problem] = problems_of(text)
    assert problem.key == "workers[1].args" and "serves as 'qwen'" in problem.fix
    # The other way round the problem is at the later worker's model.
    text = config_text(workers=[
        vllm("a", 8100, [0], args=["--served-model-name", "qwen"]),
        vllm("b", 8200, [1], model="qwen"),
    ])
    assert problem_at(text, "workers[1].model").value == '"qwen"'


def test_replicas_of_one_model_may_share_a_served_name() -> None:
    config = parse_config(config_text(workers=[
        vllm("a", 8100, [0], args=["--served-model-name", "qwen"]),
        vllm("b", 8200, [1], args=["--served-model-name", "qwen"]),
    ]))
    assert [w.served_name for w in config.workers] == ["qwen", "qwen"]


def test_extra_names_are_served_but_only_the_first_is_routed_and_that_is_warned() -> None:
    w = only_worker("--served-model-name", "qwen", "qwen3", "q")
    assert w.served_names == ("qwen", "qwen3", "q") and w.served_name == "qwen"
    config = NodeConfig(node=parse_config(config_text()).node,
                        etcd=parse_config(config_text()).etcd, workers=[w])
    [warning] = served_name_warnings(config)
    assert "workers 'w0'" in warning and "by the first, 'qwen', only" in warning
    assert "404 to requests for 'qwen3', 'q'" in warning
    assert served_name_warnings(parse_config(config_text(workers=[vllm()]))) == []


def test_check_config_warns_of_extra_names_and_strict_fails(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "lumend.toml"
    model = tmp_path / "Qwen3-32B"
    model.mkdir()  # no warning about a missing model path to blur the one checked here
    path.write_text(config_text(workers=[vllm(model=str(model), args=[
        "--served-model-name", "qwen3-32b", "qwen3"])]))

    def check(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "lumend", "check-config", *flags,
                               str(path)], capture_output=True, text=True, timeout=60)

    loose = check()
    assert loose.returncode == 0, loose.stderr
    assert "--served-model-name gives 2 names" in loose.stderr and "'qwen3'" in loose.stderr
    assert check("--strict").returncode == 2
