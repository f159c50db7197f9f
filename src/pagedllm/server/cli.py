"""``pagedllm serve``: the OpenAI-compatible server under uvicorn.

The engine core (scheduler, model runner, sampler) runs in a process of its own, started
here and spoken to over ZeroMQ (``engine/core.py``); this process does HTTP, tokenization,
detokenization and SSE. If the core dies, every request in flight fails with an error
and /health answers 503 until the server is restarted.

SIGTERM / Ctrl-C: the listening socket closes and the engine refuses new requests at once
(503, /health too); in-flight requests get ``--shutdown-timeout`` seconds to finish, then
whatever still runs is aborted (its blocks freed) and its stream ends with an error event
and ``data: [DONE]``; the step thread stops and the process exits with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from typing import Any

import uvicorn

from pagedllm.engine.args import add_engine_arguments, config_from_args
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.config import SERVE
from pagedllm.engine.core import ConfigEngineFactory
from pagedllm.server.app import DEFAULT_MAX_QUEUED_REQUESTS, create_app

# uvicorn's own deadline comes this long after ours, so that streams we end have time
# to send their last event before uvicorn would cancel them mid-stream.
_UVICORN_GRACE_S = 5.0


class GracefulServer(uvicorn.Server):
    """uvicorn whose shutdown first drains the app's engine (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain = asyncio.ensure_future(self.engine.shutdown(drain_timeout=self.drain_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            await drain


def server_for(
    app: Any, *, host: str, port: int, drain_timeout: float, **kw: Any
) -> GracefulServer:
    """A ``GracefulServer`` for an app made by ``create_app``."""
    config = uvicorn.Config(
        app, host=host, port=port, timeout_graceful_shutdown=int(drain_timeout + _UVICORN_GRACE_S),
        **kw,
    )  # fmt: skip
    return GracefulServer(config, app.state.engine, drain_timeout)


API_KEY_ENV = "PAGEDLLM_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags and the server flags to ``parser``."""
    add_engine_arguments(parser, SERVE)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help="require 'Authorization: Bearer KEY' on every route but /health (default: "
        f"${API_KEY_ENV}, which keeps the key out of the process list)",
    )
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=DEFAULT_MAX_QUEUED_REQUESTS,
        help="requests waiting for their first token beyond which new ones get 429",
    )
    group.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: --model)"
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on SIGTERM",
    )
    group.add_argument(
        "--engine-core",
        default="process",
        choices=("process", "thread"),
        help="where the engine core runs: its own process (default), or a thread of the "
        "server's (shares the interpreter lock with HTTP; for comparison)",
    )
    group.add_argument(
        "--request-log",
        metavar="FILE.jsonl",
        help="append every finished request (prompt token ids, cache_salt, cached_tokens "
        "reported, generated ids) to FILE, for `pagedllm cache-report FILE`",
    )
    group.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"))  # fmt: skip
    group.add_argument("--data-parallel-size", type=int, default=1,
                       help="N > 1: N engine processes (ports --port+1 ..) behind a prefix-aware "
                       "router on --port")  # fmt: skip
    from pagedllm.server.router_cli import add_router_arguments

    add_router_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Build the engine and serve until SIGTERM / Ctrl-C; 0 on a clean exit."""
    from pagedllm.engine.llm_engine import LLMEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.max_queued_requests < 1:
        raise SystemExit("--max-queued-requests must be at least 1")
    if args.shutdown_timeout < 0:
        raise SystemExit("--shutdown-timeout must be non-negative")
    if args.data_parallel_size < 1:
        raise SystemExit("--data-parallel-size must be at least 1")
    if args.data_parallel_size > 1:
        from pagedllm.server.data_parallel import run_data_parallel

        return run_data_parallel(args)
    config = config_from_args(args, SERVE)
    if config.node_rank > 0:  # a machine of a multi-node tensor-parallel engine: ranks only
        from pagedllm.engine.distributed import run_worker_node

        return run_worker_node(config)
    if args.engine_core == "process":
        engine: Any = AsyncEngine.launch(
            ConfigEngineFactory(config), max_queued_requests=args.max_queued_requests
        )
    else:
        engine = LLMEngine.from_config(config)
    app = create_app(
        engine,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        served_model_name=args.served_model_name,
        request_log=args.request_log,
    )
    server = server_for(
        app, host=args.host, port=args.port, drain_timeout=args.shutdown_timeout,
        log_level=args.log_level,
    )  # fmt: skip
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal so that the
    # previous handler runs; ours turns it into a clean exit instead of death by signal.
    previous = signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        server.run()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)
