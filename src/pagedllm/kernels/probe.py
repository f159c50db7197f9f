"""The CPU feature probe: what this machine's processor offers the kernels."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

# The flags the kernels and their routes depend on, in the order they are reported.
KERNEL_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@dataclass(frozen=True, slots=True)
class CpuInfo:
    """The processor's name, its feature flags (``/proc/cpuinfo``) and the CPUs this
    process may run on."""

    model: str
    flags: frozenset[str]
    num_cpus: int

    @property
    def amx(self) -> bool:
        """The AMX tile unit with bf16 multiplies."""
        return {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def bf16_dot(self) -> bool:
        """bf16 dot products in hardware (AVX-512-bf16 or AMX): bf16 runs faster than
        float32 here."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def isa(self) -> str:
        """The best vector ISA the kernels use: amx, avx512_bf16, avx512, avx2 or none."""
        if self.amx:
            return "amx"
        for flag, name in (("avx512_bf16", "avx512_bf16"), ("avx512f", "avx512"), ("avx2", "avx2")):
            if flag in self.flags:
                return name
        return "none"

    def kernel_flags(self) -> list[str]:
        """The flags of ``KERNEL_FLAGS`` this CPU has."""
        return [flag for flag in KERNEL_FLAGS if flag in self.flags]


def cpu_info() -> CpuInfo:
    """This machine's ``CpuInfo`` (flags empty where ``/proc/cpuinfo`` is unreadable)."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = value
                    break
    except OSError:
        pass
    return CpuInfo(model, frozenset(flags.split()), len(os.sched_getaffinity(0)))


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
