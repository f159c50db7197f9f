"""``pagedllm serve --data-parallel-size N``: N ``pagedllm serve`` replicas on the next N
ports, the router (``server/router.py``) in this process on ``--port``; the replicas
stop when it does. All N + 1 HTTP ports are checked free before any replica starts.

With ``--tensor-parallel-size`` too, every replica is its own process group, so each
needs its own rendezvous port: replica ``i`` takes ``--master-port + i`` (checked free
here, and clear of the HTTP ports), or a free port of its own choosing without
``--master-port``. A machine with ``--node-rank K > 0`` serves no HTTP: it starts the
ranks of each replica (``pagedllm serve --node-rank K --master-port P+i``) and waits::

    machine 0:  router :8000   replica 0 :8001 (ranks 0..  , rendezvous P)
                               replica 1 :8002 (ranks 0..  , rendezvous P+1)
    machine 1:                 replica 0's ranks -> P       replica 1's ranks -> P+1
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import httpx

from pagedllm.server.process import API_KEY_ENV, UVICORN_GRACE_S, exit_cleanly
from pagedllm.util.net import port_free

REPLICA_START_TIMEOUT_S = 600.0


def run_data_parallel(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Start the replicas (or, on a machine with ``--node-rank > 0``, their ranks) and
    serve the router until SIGTERM / Ctrl-C; 0 on a clean exit. ``parser``: the serve
    flags that ``args`` came from (``server.cli.serve_parser``)."""
    master_ports = replica_master_ports(args)
    check_http_ports(args)
    procs: list[subprocess.Popen] = []
    # uvicorn re-raises SIGTERM after its shutdown; a clean exit lets the replicas stop.
    previous = signal.signal(signal.SIGTERM, exit_cleanly)
    api_key = args.api_key
    # The key reaches the replicas through their environment, not their argv (ps shows it).
    env = {**os.environ, API_KEY_ENV: api_key} if api_key else None
    try:
        urls = []
        for i, master_port in enumerate(master_ports):
            port = args.port + 1 + i
            argv = replica_argv(parser, args, port, master_port)
            command = [sys.executable, "-m", "pagedllm.cli", "serve", *argv]
            procs.append(subprocess.Popen(command, env=env))
            urls.append(f"http://{_client_host(args.host)}:{port}")
        if args.node_rank > 0:
            return max(proc.wait() for proc in procs)
        _wait_healthy(urls, procs)
        from pagedllm.server.router_cli import serve_router

        serve_router(args, urls, args.model, api_key)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(args.shutdown_timeout + UVICORN_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


def replica_master_ports(args: argparse.Namespace) -> list[int | None]:
    """Each replica's rendezvous port: ``--master-port + i``, or None (the replica picks
    a free one) without ``--master-port``. ``SystemExit`` naming the port when one would
    clash with the HTTP ports, or (on machine 0, where the ranks' store listens) is taken."""
    n = args.data_parallel_size
    if args.master_port is None:
        return [None] * n
    ports = list(range(args.master_port, args.master_port + n))
    http = range(args.port, args.port + n + 1)
    clash = [p for p in ports if p in http]
    if clash:
        raise SystemExit(
            f"--master-port {args.master_port} gives the {n} replicas the rendezvous ports "
            f"{ports[0]}-{ports[-1]}, which overlap the HTTP ports {http[0]}-{http[-1]} "
            f"(--port and the replicas'): choose a --master-port outside them"
        )
    if ports[-1] > 65535:
        raise SystemExit(f"--master-port {args.master_port} + {n - 1} replicas passes 65535")
    if args.node_rank == 0:
        taken = [p for p in ports if not port_free(p)]
        if taken:
            raise SystemExit(
                f"rendezvous port {taken[0]} (--master-port {args.master_port} + replica "
                f"{taken[0] - args.master_port}) is already in use: choose another --master-port"
            )
    return list(ports)


def check_http_ports(args: argparse.Namespace) -> None:
    """``SystemExit`` naming the port when the router's ``--port`` or a replica's
    (``--port + 1 + i``) is taken: checked before any replica loads its model, where a
    taken port would otherwise leave one replica dead behind a router that waits for it.
    Machines with ``--node-rank > 0`` serve no HTTP and check nothing."""
    if args.node_rank > 0:
        return
    n = args.data_parallel_size
    if args.port + n > 65535:
        raise SystemExit(f"--port {args.port} + {n} replicas passes 65535")
    for port in range(args.port, args.port + n + 1):
        if not port_free(port):
            who = (
                "the router's --port" if port == args.port else f"replica {port - args.port - 1}'s"
            )
            raise SystemExit(
                f"port {port} ({who}: replicas serve on --port + 1 .. --port + {n}) is already "
                f"in use: choose another --port"
            )


def replica_argv(
    parser: argparse.ArgumentParser, args: argparse.Namespace, port: int, master_port: int | None
) -> list[str]:
    """This command's flags (``args``, parsed by ``parser``) for one replica: the same values,
    its own HTTP port and rendezvous port, no data parallelism."""
    argv = ["--port", str(port)]
    if master_port is not None:
        argv += ["--master-port", str(master_port)]
    for action in parser._actions:
        dest = action.dest
        if dest in ("help", "port", "master_port", "data_parallel_size", "api_key"):
            continue
        if not action.option_strings:
            continue
        value = getattr(args, dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else f"--no-{flag[2:]}")
        else:
            argv += [flag, str(value)]
    return argv


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _wait_healthy(urls: list[str], procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + REPLICA_START_TIMEOUT_S
    pending = list(zip(urls, procs, strict=True))
    while pending:
        url, proc = pending[0]
        if proc.poll() is not None:
            raise SystemExit(f"replica {url} exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"replica {url} did not come up in {REPLICA_START_TIMEOUT_S:.0f} s")
        time.sleep(0.2)
