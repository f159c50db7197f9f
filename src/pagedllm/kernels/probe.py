"""The CPU feature probe: what this machine's processor offers the kernels."""

from __future__ import annotations

import sys


def cpu_flags_line() -> str:
    """The ``flags`` line of ``/proc/cpuinfo`` (part of a build's identity), or the platform."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return sys.platform
