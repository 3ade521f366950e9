"""The sim draft server process: what a recovering sim worker runs while its engine reloads.

    python -m lumend.assist.sim_drafter --listen 127.0.0.1:8190 --model sim-small \
        --seed 0 --agreement 0.8

It drafts with `SimDraftFunction` (the target's token function, right with probability
`--agreement`) and serves the draft-assist protocol (lumend.assist.server), with CURVE when
LUMEN_CKPT_KEYS names the cluster's key file (lumend sets it, as for engines).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

from lumend.assist.server import DraftBindError, DraftServer, DraftServerConfig
from lumend.assist.sim_draft import SimDraftFunction
from lumend.checkpoint.security import ENV_VAR, KeyFileError, client_keys_from_env
from lumend.engine.sim_models import sim_model
from lumend.failover.lifeline import die_with_supervisor

log = logging.getLogger("lumend.assist")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lumend draft-sim",
        description="LUMEN sim draft server: drafts for a survivor's sim engine over ZeroMQ "
        f"(CURVE with the cluster keys named by {ENV_VAR}).")
    p.add_argument("--listen", required=True, help="host:port to bind (port 0: any free one)")
    p.add_argument("--model", default="sim-small", help="the sim model drafted for")
    p.add_argument("--seed", type=int, default=0, help="the target engines' seed")
    p.add_argument("--agreement", type=float, default=0.8,
                   help="probability that a drafted token is the target's (0..1)")
    p.add_argument("--draft-seed", type=int, default=0,
                   help="seed of the drafter's mistakes (same seed, same drafts)")
    p.add_argument("--seconds-per-token", type=float, default=0.0,
                   help="modelled draft cost per drafted token (before --time-scale)")
    p.add_argument("--load-s", type=float, default=0.0,
                   help="modelled draft-model load time before serving (before --time-scale)")
    p.add_argument("--endpoint-file",
                   help="write the bound endpoint (tcp://host:port) here once serving")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--log-level", default="INFO")
    return p


async def serve(args: argparse.Namespace) -> None:
    keys = client_keys_from_env()  # the whole key file: the server pair is in it too
    function = SimDraftFunction(args.seed, args.agreement, args.draft_seed,
                                args.seconds_per_token * args.time_scale)
    server = DraftServer(DraftServerConfig(listen=args.listen, model=args.model, curve=keys),
                         function)
    await asyncio.sleep(args.load_s * args.time_scale)
    server.bind()
    if args.endpoint_file:
        write_endpoint(Path(args.endpoint_file), server.endpoint)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.run(stop)
    s = server.stats()
    log.info("draft server stopped: %d rounds, %d drafted tokens, %d resyncs, refused %s",
             s.rounds, s.drafted_tokens, s.resyncs, s.refused)


def write_endpoint(path: Path, endpoint: str) -> None:
    """Atomically: the supervisor never reads half an address."""
    partial = path.with_suffix(".partial")
    partial.write_text(endpoint + "\n")
    os.replace(partial, path)


def main() -> None:
    die_with_supervisor()
    p = parser()
    args = p.parse_args()
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sim_model(args.model)
        SimDraftFunction(args.seed, args.agreement)
    except ValueError as exc:
        p.error(str(exc))
    try:
        asyncio.run(serve(args))
    except (KeyFileError, DraftBindError) as exc:
        p.exit(2, f"lumend draft-sim: {exc}\n")


if __name__ == "__main__":
    main()
