"""``pagedllm serve``: the OpenAI-compatible server under uvicorn.

SIGTERM / Ctrl-C: uvicorn stops accepting connections and waits up to
``--shutdown-timeout`` seconds for in-flight requests to finish; the app's lifespan then
aborts whatever is left (freeing its blocks) and stops the step thread.
"""

from __future__ import annotations

import argparse
import logging
import signal

from pagedllm.engine.args import add_engine_arguments, config_from_args
from pagedllm.server.app import DEFAULT_MAX_QUEUED_REQUESTS, create_app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags and the server flags to ``parser``."""
    add_engine_arguments(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health",
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
    group.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"))  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Build the engine and serve until SIGTERM / Ctrl-C; 0 on a clean exit."""
    import uvicorn

    from pagedllm.engine.llm_engine import LLMEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.max_queued_requests < 1:
        raise SystemExit("--max-queued-requests must be at least 1")
    engine = LLMEngine.from_config(config_from_args(args))
    app = create_app(
        engine,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        served_model_name=args.served_model_name,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=max(1, int(args.shutdown_timeout)),
    )
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal so that the
    # previous handler runs; ours turns it into a clean exit instead of death by signal.
    previous = signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        uvicorn.Server(config).run()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)
