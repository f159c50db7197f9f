"""What every ``pagedllm serve`` process agrees on, the data-parallel parent and its
replicas alike: where the API key travels, how long uvicorn waits past our drain deadline,
and SIGTERM as a clean exit."""

from __future__ import annotations

# The key travels in the environment, not in argv, where ps would show it.
API_KEY_ENV = "PAGEDLLM_API_KEY"

# uvicorn's own deadline comes this long after ours, so that streams we end have time
# to send their last event before uvicorn would cancel them mid-stream.
UVICORN_GRACE_S = 5.0


def exit_cleanly(signum: int, frame: object) -> None:
    """A SIGTERM handler: uvicorn re-raises the signal after its shutdown, and this turns it
    into a clean exit instead of death by signal."""
    raise SystemExit(0)
