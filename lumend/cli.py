"""`lumend`: run a node, check its configuration, or run one of its child processes."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import typer

from lumend import __version__
from lumend.config import DEFAULT_CONFIG_PATH, ConfigError, NodeConfig, load_config

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
) -> None:
    """Validate a node config: exit 0 when valid, 2 with every problem listed when not."""
    config = load_config_or_exit(path)
    from lumend.engine.vllm_version import vllm_worker_warnings  # metadata only, no vLLM

    for warning in vllm_worker_warnings([(w.name, w.engine) for w in config.workers]):
        typer.echo(f"{path}: warning: {warning}", err=True)
    typer.echo(
        f"{path}: ok (node {config.node.name}, cluster {config.etcd.cluster!r}, "
        f"{len(config.workers)} workers)"
    )


@app.command("run")
def run(
    config_path: Path = typer.Option(
        Path(DEFAULT_CONFIG_PATH), "--config", "-c", help="The node config (TOML)."
    ),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Run the node until SIGTERM or SIGINT (then resign and deregister); SIGHUP reloads the
    config. Under systemd (Type=notify) it reports readiness, status and watchdog pings."""
    config = load_config_or_exit(config_path)
    level = logging.getLevelName(log_level.upper())
    if not isinstance(level, int):
        typer.echo(f"--log-level {log_level!r} is not a level; use debug, info, warning or "
                   "error", err=True)
        raise typer.Exit(EXIT_CONFIG)
    from lumend.daemon import StartupError, run_node  # deferred: check-config stays light
    from lumend.notify import log_handler

    logging.basicConfig(level=level, handlers=[log_handler(config.node.name)])
    try:
        asyncio.run(run_node(config, config_path))
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
