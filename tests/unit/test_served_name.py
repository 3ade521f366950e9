"""A worker's served name: vLLM's --served-model-name in its args, else its model. The
cluster routes, lists and matches by it; the engine still loads `model` (issue 17)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lumend.cluster.models import WorkerRecord
from lumend.cluster.view import ClusterView
from lumend.config import WorkerConfig, parse_config, served_model_names
from lumend.engine.adapter import VllmAdapter
from lumend.failover.supervisor import WorkerSupervisor
from lumend.gateway.routing import models, served_as

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


def test_extra_names_are_the_records_aliases_routed_as_the_first(tmp_path: Path) -> None:
    w = only_worker("--served-model-name", "qwen", "qwen3", "q")
    assert w.served_names == ("qwen", "qwen3", "q") and w.served_name == "qwen"
    supervisor = WorkerSupervisor("n1", w, VllmAdapter(cuda=False),
                                  runtime_dir=tmp_path / "run", log_dir=tmp_path / "logs")
    record = supervisor.record()
    assert record.model == "qwen" and record.aliases == ["qwen3", "q"]
    other = WorkerRecord(name="w1", node="n2", gpus=[0], engine="vllm", model="llama",
                         state="serving", updated_at=0.0)
    view = ClusterView("c", 1, workers={"w0": record, "w1": other})
    assert models(view) == ["llama", "q", "qwen", "qwen3"]  # /v1/models lists every name
    assert [served_as(view, n) for n in ("qwen", "qwen3", "q", "llama", QWEN)] == [
        "qwen", "qwen", "qwen", "llama", None]
    # control: one name, no aliases
    assert WorkerSupervisor("n1", only_worker("--served-model-name", "qwen"),
                            VllmAdapter(cuda=False), runtime_dir=tmp_path / "r2",
                            log_dir=tmp_path / "l2").record().aliases == []


def test_an_alias_serving_another_model_collides_too() -> None:
    text = config_text(workers=[
        vllm("a", 8100, [0], args=["--served-model-name", "qwen", "fast"]),
        vllm("b", 8200, [1], model="/models/Qwen3-8B",
             args=["--served-model-name", "small", "fast"]),
    ])
    [problem] = problems_of(text)
    assert problem.key == "workers[1].args" and "serves as 'fast'" in problem.fix


@pytest.mark.parametrize("args", [["--model", "/models/Other"], ["--model=/models/Other"],
                                  ["--dtype", "bfloat16", "--model", "/models/Other"]])
def test_a_second_model_in_args_is_an_error_naming_the_model_key(args: list[str]) -> None:
    # lumend gives `model` to the engine as --model; one in args wins in vLLM's parser, and the
    # engines would serve a model the cluster does not route to them (every request a 404).
    fix = problem_at(config_text(workers=[vllm(args=args)]), "workers[0].args").fix
    assert "--model" in fix and "model key" in fix and "drop --model" in fix


def test_options_that_only_start_like_model_are_no_model() -> None:
    # Control: --model-impl and --model-loader-extra-config are other vLLM options.
    w = only_worker("--model-impl", "vllm", "--model-loader-extra-config", "{}")
    assert w.served_name == QWEN
