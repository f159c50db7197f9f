"""`pagedllm serve | generate | plan | router | cache-report | env` — one dispatcher; each
command lives with its layer."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS = {
    "serve": ("pagedllm.server.cli", "OpenAI-compatible HTTP server"),
    "generate": ("pagedllm.engine.cli_generate", "generate text for a prompt offline"),
    "router": ("pagedllm.server.router_cli", "route requests to data-parallel replicas by prefix"),
    "plan": ("pagedllm.planner.cli", "how many concurrent sessions fit in given memory"),
    "cache-report": (
        "pagedllm.engine.cli_cache_report",
        "why prompts of a request log are not cached, and what it costs",
    ),
    "env": ("pagedllm.engine.cli_env", "this machine's CPU, threads, kernels and each route"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Build only the chosen command's parser: importing every layer costs seconds.
    chosen = next((a for a in argv if a in COMMANDS), None)
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(command_parser)
            command_parser.set_defaults(_module=module)
    args = parser.parse_args(argv)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
