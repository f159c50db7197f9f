"""Suite-wide settings: offline hub, Hypothesis profiles, torch threads; the C++ kernels as a
fixture; ``--deep``."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread per process: tests are many small ops, and servers started by tests run beside them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from pagedllm.kernels.ops import layer_ops  # noqa: E402

settings.register_profile(
    "ci", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session")
def kernel_ops() -> Any:
    """``torch.ops.pagedllm``: the C++ kernels, built (once per machine) when a test first asks,
    never while the suite is collected; the test is skipped where they do not build."""
    ops = layer_ops()
    if ops is None:
        pytest.skip("the C++ kernels did not build")
    return ops


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--deep",
        action="store_true",
        help="fuzz the server's OpenAPI schema with thousands of requests (test_openapi_fuzz)",
    )
