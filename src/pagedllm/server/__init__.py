"""The OpenAI-compatible HTTP server: ``create_app(engine)`` and ``pagedllm serve``."""

from pagedllm.server.app import create_app

__all__ = ["create_app"]
