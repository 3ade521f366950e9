"""`lumend`: run a node, check its configuration, or run one of its child processes."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from lumend import __version__
from lumend.config import DEFAULT_CONFIG_PATH, ConfigError, NodeConfig, load_config
from lumend.engine.vllm_memory import looks_like_path, weights_on_disk

app = typer.Typer(
    name="lumend",
    help="The per-node LUMEN daemon: joins the cluster in etcd, holds or follows the "
    "coordinator role, supervises the node's engines.",
    no_args_is_help=True,
    add_completion=False,
)

EXIT_FAILED = 1
EXIT_CONFIG = 2


@app.command("check-config")
def check_config(
    path: Path = typer.Argument(Path(DEFAULT_CONFIG_PATH), help="The node config (TOML)."),
    strict: bool = typer.Option(
        False, "--strict", help="Warnings are errors (exit 2): a model path that does not "
        "exist or that this user cannot read, an unsupported vLLM, a GPU host without "
        "cuda-python (the gpu extra) for its vLLM workers' GMS servers, GPU engines with no "
        "memory split that lumend cannot compute here (from nvidia-smi and the model's "
        "weight files) or that do not fit together. The Ansible role checks "
        "with --strict, so a node without its models fails the deploy."),
) -> None:
    """Validate a node config: exit 0 when valid, 2 with every problem listed when not.
    Also checks, as warnings, what the node needs besides the file: each worker's model and
    draft_model that is a path (absolute, or starting with ./ or ~) exists and is readable
    by the user running the check (run it as lumend's user), a vLLM lumend supports, and on
    a GPU host that cuda-python (the gpu extra) is there for single-GPU vLLM workers' GMS
    servers and that each vLLM worker with shadows has a memory split that fits its GPUs
    (set, or the kv_cache_bytes lumend will compute, printed)."""
    config = load_config_or_exit(path)
    from lumend.engine.vllm_version import vllm_worker_warnings  # metadata only, no vLLM

    warnings = model_path_warnings(config)
    warnings += vllm_worker_warnings([(w.name, w.engine) for w in config.workers])
    warnings += gpu_extra_warnings(config)
    notes, memory = memory_checks(config)
    warnings += memory
    for note in notes:
        typer.echo(f"{path}: {note}")
    for warning in warnings:
        typer.echo(f"{path}: {'error' if strict else 'warning'}: {warning}", err=True)
    if strict and warnings:
        typer.echo(f"{path}: {len(warnings)} problems (--strict)", err=True)
        raise typer.Exit(EXIT_CONFIG)
    typer.echo(
        f"{path}: ok (node {config.node.name}, cluster {config.etcd.cluster!r}, "
        f"{len(config.workers)} workers)"
    )


# systemd's ProtectHome=yes (the shipped unit) makes these empty for lumend and its engines.
HIDDEN_BY_UNIT = ("/home", "/root", "/run/user")


def model_path_warnings(config: NodeConfig) -> list[str]:
    """What is wrong with each worker's model paths on this host: missing, unreadable, or
    where the unit hides it. Hub ids and sim presets are not checked."""
    found = []
    for worker in config.workers:
        for key, model in (("model", worker.model), ("draft_model", worker.draft_model)):
            if model is None or worker.engine == "sim" or not looks_like_path(model):
                continue
            where = f"workers {worker.name!r}: {key} = {model!r}"
            local = os.path.expanduser(model)
            if not os.path.exists(local):
                found.append(f"{where}: no such file or directory on this host; copy the "
                             "model there on every node that runs this worker (or mount "
                             "the shared store there) before lumend starts")
            elif not os.access(local, os.R_OK) or (
                    os.path.isdir(local) and not os.access(local, os.X_OK)):
                found.append(f"{where}: this user cannot read it; make it readable by the "
                             "user lumend runs as (e.g. chgrp -R lumen and chmod -R g+rX)")
            elif os.path.isdir(local) and not any(
                    name.endswith((".safetensors", ".bin", ".gguf", ".pt"))
                    for name in os.listdir(local)):
                found.append(f"{where}: the directory holds no weight files (*.safetensors, "
                             "*.bin, *.gguf); is the copy complete?")
            hidden = next((h for h in HIDDEN_BY_UNIT
                           if local == h or local.startswith(h + "/")), None)
            if hidden:
                found.append(f"{where}: under {hidden}, which the lumend unit hides "
                             "(ProtectHome=yes); put models elsewhere, e.g. /models, or "
                             "allow it with a drop-in (systemctl edit lumend)")
    return found


def gpu_extra_warnings(config: NodeConfig, nvidia_device: Path = Path("/dev/nvidiactl"),
                       import_module: Callable[[str], Any] = importlib.import_module,
                       ) -> list[str]:
    """On a host with the NVIDIA driver (`nvidia_device` exists), the vLLM workers whose GMS
    server runs the cuda backend (WorkerConfig.fits_cuda_gms) need
    cuda-python, LUMEN's gpu extra; without it their GMS servers exit at start and the
    workers never serve. `import_module`: how cuda-python's bindings are imported (tests
    pass a fake)."""
    names = [w.name for w in config.workers if w.engine == "vllm" and w.fits_cuda_gms]
    if not names or not nvidia_device.exists():
        return []
    from lumend.gms.cuda_vmm import (
        GPU_EXTRA_HINT,
        CudaPythonMissing,
        CudaUnavailable,
        import_bindings,
    )

    where = f"workers {', '.join(repr(n) for n in names)} (vllm, one GPU)"
    try:
        import_bindings(import_module)
    except CudaPythonMissing:
        return [f"{where}: this GPU host lacks cuda-python, which their GMS servers (cuda "
                f"backend, {nvidia_device} exists) need: they would exit at start and the "
                f"workers never serve; {GPU_EXTRA_HINT}"]
    except CudaUnavailable as exc:
        return [f"{where}: their GMS servers (cuda backend) cannot use CUDA here: {exc}"]
    return []


def memory_checks(config: NodeConfig) -> tuple[list[str], list[str]]:
    """On a host with NVIDIA GPUs: each vLLM worker with shadows has a memory split, set or
    computed, and its engines fit on its GPUs together (lumend.config.memory_split_warnings).
    Returns (notes: the splits lumend will compute, warnings)."""
    from lumend.config import computed_split_note, computes_memory_split, memory_split_warnings
    from lumend.engine.adapter import cuda_present
    from lumend.engine.vllm_memory import gpu_total_bytes

    if not cuda_present():
        return [], []
    notes: list[str] = []
    found: list[str] = []
    for worker in config.workers:
        if worker.engine == "vllm" and worker.shadows:
            total = (gpu_total_bytes(worker.gpus)
                     if worker.kv_cache_bytes or computes_memory_split(worker) else None)
            weights = weights_on_disk(worker.model)
            found += memory_split_warnings(worker, total, weights)
            note = computed_split_note(worker, total, weights)
            if note is not None:
                notes.append(note)
    return notes, found


@app.command("run")
def run(
    config_path: Path = typer.Option(
        Path(DEFAULT_CONFIG_PATH), "--config", "-c", help="The node config (TOML)."
    ),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Run the node until SIGTERM or SIGINT (then resign and deregister); SIGHUP reloads the
    config. Under systemd (Type=notify) it reports readiness, status and watchdog pings."""
    from lumend.gateway import eventloop

    try:  # uvloop when installed, unless LUMEN_EVENT_LOOP=asyncio (lumend/gateway/eventloop.py)
        loop = eventloop.choose()
    except eventloop.LoopChoiceError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    config = load_config_or_exit(config_path)
    level = logging.getLevelName(log_level.upper())
    if not isinstance(level, int):
        typer.echo(f"--log-level {log_level!r} is not a level; use debug, info, warning or "
                   "error", err=True)
        raise typer.Exit(EXIT_CONFIG)
    from lumend.daemon import StartupError, run_node  # deferred: check-config stays light
    from lumend.notify import log_handler

    logging.basicConfig(level=level, handlers=[log_handler(config.node.name)])
    logging.getLogger("lumend").info("event loop: %s (%s=asyncio or uvloop to choose)", loop,
                                     eventloop.ENV)
    try:
        eventloop.run(run_node(config, config_path), loop)
    except StartupError as exc:
        logging.getLogger("lumend").error("cannot start: %s", exc)
        raise typer.Exit(EXIT_FAILED) from None


_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.command("engine-sim", context_settings=_PASSTHROUGH, add_help_option=False)
def engine_sim(ctx: typer.Context) -> None:
    """Run a sim engine (lumend's supervisor starts these; `lumend engine-sim --help`)."""
    from lumend.engine import sim_server

    sys.argv = ["lumend engine-sim", *ctx.args]
    sim_server.main()


@app.command("draft-sim", context_settings=_PASSTHROUGH, add_help_option=False)
def draft_sim(ctx: typer.Context) -> None:
    """Run a sim draft server (a recovering sim worker's drafter; `lumend draft-sim --help`)."""
    from lumend.assist import sim_drafter

    sys.argv = ["lumend draft-sim", *ctx.args]
    sim_drafter.main()


@app.command("gms-server", context_settings=_PASSTHROUGH, add_help_option=False)
def gms_server(ctx: typer.Context) -> None:
    """Run a GPU Memory Service server (one per worker; `lumend gms-server --help`)."""
    from lumend.gms import server

    sys.argv = ["lumend gms-server", *ctx.args]
    server.main()


@app.command("version")
def version() -> None:
    """Print the version."""
    typer.echo(__version__)


def load_config_or_exit(path: Path) -> NodeConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(EXIT_CONFIG) from None


def main() -> None:
    app()
