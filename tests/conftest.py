"""Suite-wide settings: offline hub, Hypothesis profiles, torch threads."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread per process: tests are many small ops, and servers started by tests run beside them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
