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
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)

# PAGEDLLM_MAX_ISA caps the kernels at one of these ISAs (as ATEN_CPU_CAPABILITY caps torch's):
# the /proc/cpuinfo flags above the cap (by prefix) and the compiler switches that leave their
# instructions out of the build. "avx2" is an AMD Zen 3 (no AVX-512, no AVX-VNNI), "avx512"
# an AVX-512 CPU without bf16 dot products, "avx512_bf16" a Zen 4 (no tile unit).
MAX_ISA_VARIABLE = "PAGEDLLM_MAX_ISA"
_AMX_SWITCHES = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
ABOVE_ISA: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx2": (("avx512", "avx_vnni", "amx"), ("-mno-avx512f", "-mno-avxvnni", *_AMX_SWITCHES)),
    "avx512": (("avx512_bf16", "amx"), ("-mno-avx512bf16", *_AMX_SWITCHES)),
    "avx512_bf16": (("amx",), _AMX_SWITCHES),
    "amx": ((), ()),
}


@dataclass(frozen=True, slots=True)
class CpuInfo:
    """The processor's name, its feature flags (``/proc/cpuinfo``) and the CPUs this
    process may run on."""

    model: str
    flags: frozenset[str]
    num_cpus: int
    # "family 25 model 17": a cloud guest often names only "AMD EPYC".
    family: str = ""
    # The PAGEDLLM_MAX_ISA the flags were capped at, if any.
    cap: str | None = None

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

    @property
    def label(self) -> str:
        """The name, family / model numbers and kernel ISA, for benchmark reports."""
        isa = f"{self.isa}, {MAX_ISA_VARIABLE}={self.cap}" if self.cap else self.isa
        details = ", ".join(part for part in (self.family, isa) if part)
        return f"{self.model} ({details})"

    def kernel_flags(self) -> list[str]:
        """The flags of ``KERNEL_FLAGS`` this CPU has."""
        return [flag for flag in KERNEL_FLAGS if flag in self.flags]


def max_isa() -> str | None:
    """The ISA ``PAGEDLLM_MAX_ISA`` caps the kernels at (``None``: not capped); ``ValueError``
    naming the variable for an unknown one."""
    cap = os.environ.get(MAX_ISA_VARIABLE, "")
    if cap and cap not in ABOVE_ISA:
        raise ValueError(f"{MAX_ISA_VARIABLE}={cap!r}: use one of {', '.join(ABOVE_ISA)}")
    return cap or None


def capped_flags(flags: frozenset[str]) -> frozenset[str]:
    """``flags`` less those above ``max_isa()``."""
    cap = max_isa()
    above = ABOVE_ISA[cap][0] if cap else ()
    return frozenset(flag for flag in flags if not flag.startswith(above))


def cap_switches() -> list[str]:
    """The compiler switches that keep the kernels' build within ``max_isa()``."""
    cap = max_isa()
    return list(ABOVE_ISA[cap][1]) if cap else []


def cpu_info() -> CpuInfo:
    """This machine's ``CpuInfo`` (flags empty where ``/proc/cpuinfo`` is unreadable), its
    flags capped by ``PAGEDLLM_MAX_ISA``."""
    model, flags = platform.processor() or platform.machine(), ""
    numbers: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:  # the first processor's lines; "flags" comes after the others
                key, _, value = (part.strip() for part in line.partition(":"))
                if key == "model name" and value:
                    model = value
                elif key in ("cpu family", "model"):
                    numbers[key] = value
                elif key == "flags":
                    flags = value
                    break
    except OSError:
        pass
    family = f"family {numbers['cpu family']} model {numbers['model']}" if len(numbers) == 2 else ""
    flagset = capped_flags(frozenset(flags.split()))
    return CpuInfo(model, flagset, len(os.sched_getaffinity(0)), family, max_isa())


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
