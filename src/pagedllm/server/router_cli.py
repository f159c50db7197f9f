"""``pagedllm router --replica URL ...``: the prefix-aware router under uvicorn."""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from pagedllm.core.routing import CACHE_EVENT_FEEDS, ROUTING_POLICIES

REPLICA_API_KEY_ENV = "PAGEDLLM_REPLICA_API_KEY"


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    """The routing flags (shared with ``serve --data-parallel-size``)."""
    group = parser.add_argument_group("router")
    group.add_argument("--routing-policy", default="prefix_aware", choices=ROUTING_POLICIES,
                       help="prefix_aware (default), or the baselines round_robin, least_loaded")  # fmt: skip
    group.add_argument("--max-imbalance", type=int, default=8,
                       help="requests in flight beyond the idlest replica's past which a prefix "
                       "hit no longer wins (prefix_aware)")  # fmt: skip
    group.add_argument("--cache-events", default="stream", choices=CACHE_EVENT_FEEDS,
                       help="stream (default): each replica pushes its cache events as its "
                       "engine logs them (SSE); poll: read them every --poll-interval")  # fmt: skip
    group.add_argument("--poll-interval", type=float, default=0.1,
                       help="seconds between reads of the replicas' cache events (polled, "
                       "or between two streams)")  # fmt: skip
    group.add_argument("--poll-timeout", type=float, default=5.0,
                       help="seconds a replica may take to answer a read of its cache events "
                       "(or its stream stay silent) before it is marked unhealthy (it gets "
                       "traffic again once it answers)")  # fmt: skip
    group.add_argument("--refresh-older-than-ms", type=float, default=None, metavar="MS",
                       help="before routing, re-read the events of every replica whose view "
                       "is older than MS and not streamed (a round trip per request)")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica", action="append", required=True, metavar="URL",
                        help="a replica's base URL (repeat for each)")  # fmt: skip
    parser.add_argument("--tokenizer", default="default",
                        help="the replicas' model (directory, .gguf or 'default'), for its tokenizer")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"))  # fmt: skip
    parser.add_argument("--replica-api-key", default=os.environ.get(REPLICA_API_KEY_ENV) or None,
                        metavar="KEY",
                        help="the replicas' --api-key: sent on the router's own reads of their "
                        "cache events (clients' requests pass on their own Authorization; "
                        f"default: ${REPLICA_API_KEY_ENV})")  # fmt: skip
    add_router_arguments(parser)


def serve_router(
    args: argparse.Namespace,
    replica_urls: list[str],
    tokenizer_model: str,
    replica_api_key: str | None,
) -> None:
    """Run the router app until SIGTERM / Ctrl-C."""
    from pagedllm.model.loader import load_tokenizer
    from pagedllm.server.router import create_router_app

    refresh_ms = args.refresh_older_than_ms
    if args.max_imbalance < 0 or args.poll_interval <= 0 or args.poll_timeout <= 0:
        raise SystemExit(
            "--max-imbalance must be >= 0, --poll-interval and --poll-timeout positive"
        )
    if refresh_ms is not None and refresh_ms < 0:
        raise SystemExit("--refresh-older-than-ms must be >= 0")
    app = create_router_app(
        replica_urls,
        tokenizer=load_tokenizer(tokenizer_model),
        policy=args.routing_policy,
        max_imbalance=args.max_imbalance,
        poll_interval=args.poll_interval,
        poll_timeout=args.poll_timeout,
        cache_events=args.cache_events,
        refresh_older_than=None if refresh_ms is None else refresh_ms / 1000,
        replica_api_key=replica_api_key,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    serve_router(args, args.replica, args.tokenizer, args.replica_api_key)
    return 0
