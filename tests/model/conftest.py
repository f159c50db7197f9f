"""Fixtures for the model tests: tiny checkpoints built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from .parity_helpers import VARIANTS, build_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """Lazily built checkpoints, one per variant name, shared by the session."""
    cache: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in cache:
            arch, overrides = VARIANTS[variant]
            cache[variant] = build_checkpoint(tmp_path_factory.mktemp(variant), arch, **overrides)
        return cache[variant]

    return get


@pytest.fixture
def tiny_llama(checkpoints) -> Path:
    return checkpoints("llama_gqa")
