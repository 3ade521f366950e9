"""A stand-in for vLLM's API server around LUMEN's gate, for the sleep-mode protocol on a
machine where vLLM's sleep mode cannot run (it needs CUDA): the real gate middleware, and
/sleep, /wake_up and a completion route that record what the gate asked for, and a
/collective_rpc route standing in for vLLM's other dev endpoints.

    python tests/failover/gate_app.py PORT [HOST]"""

from __future__ import annotations

import sys
import time

import uvicorn
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

calls: list[str] = []


async def sleep(request: Request) -> JSONResponse:
    calls.append("sleep:" + request.query_params.get("level", ""))
    return JSONResponse({})


async def wake_up(request: Request) -> JSONResponse:
    calls.append("wake_up")
    return JSONResponse({})


async def collective_rpc(request: Request) -> JSONResponse:
    calls.append("collective_rpc")
    return JSONResponse({"results": []})


async def recorded(request: Request) -> JSONResponse:
    return JSONResponse({"calls": calls, "t": time.time()})


async def completions(request: Request) -> JSONResponse:
    return JSONResponse({"choices": [{"text": "ok"}]})


def main() -> None:
    from lumend.engine.vllm_gate import gate  # as vLLM loads it: once the engine is up

    app = Starlette(routes=[
        Route("/sleep", sleep, methods=["POST"]), Route("/wake_up", wake_up, methods=["POST"]),
        Route("/collective_rpc", collective_rpc, methods=["POST"]),
        Route("/calls", recorded), Route("/v1/completions", completions, methods=["POST"]),
    ])
    app.add_middleware(BaseHTTPMiddleware, dispatch=gate)
    host = sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1"
    uvicorn.run(app, host=host, port=int(sys.argv[1]), log_level="warning")


if __name__ == "__main__":
    main()
