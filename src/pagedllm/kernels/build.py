"""The compiler driver: builds the C++ kernels (``csrc/*.cpp``) into one shared library with the
system compiler on first use, caches it under ``$PAGEDLLM_CACHE/extensions`` (default
``~/.cache/pagedllm``; the ``KEPT_BUILDS`` most recently used builds are kept) and loads it into
``torch.ops.pagedllm``. If the build fails every caller falls back to its torch path.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pagedllm.kernels.probe import cap_switches, cpu_flags_line, max_isa

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "paged_attention.cpp",
        "paged_attention_avx2.cpp",
        "prefill_attention.cpp",
        "prefill_attention_avx2.cpp",
        "cpu_ops.cpp",
        "small_gemm.cpp",
        "small_gemm_amx.cpp",
        "small_gemm_avx512.cpp",
        "small_gemm_avx2.cpp",
        "decoder_layers.cpp",
        "gemma_layers.cpp",
        "quant_attention.cpp",
        "quant_write.cpp",
        "quant_gemm.cpp",
        "quant_tiles.cpp",
        "sample.cpp",
    )
)
# Included by the sources: part of the build's hash, not compiled on their own.
HEADERS = tuple(
    CSRC / name
    for name in (
        "amx.h",
        "vec.h",
        "vec_avx2.h",
        "small_gemm.h",
        "parallel.h",
        "paged_attention.h",
        "prefill_attention.h",
        "layer_groups.h",
        "step_head.h",
        "kv_formats.h",
        "dispatch.h",
        "quant_formats.h",
        "argmax.h",
    )
)


def cache_dir() -> Path:
    """Where compiled kernels live: ``$PAGEDLLM_CACHE/extensions`` or ``~/.cache/pagedllm/...``."""
    root = os.environ.get("PAGEDLLM_CACHE") or Path.home() / ".cache" / "pagedllm"
    return Path(root) / "extensions"


@functools.cache
def load_library() -> bool:
    """Build (once per machine) and load the C++ kernels; ``False`` if that is impossible.

    ``PAGEDLLM_NO_EXTENSION=1`` disables them (torch paths are used instead);
    ``PAGEDLLM_MAX_ISA`` builds them for an older CPU than this one (probe.py).
    """
    if os.environ.get("PAGEDLLM_NO_EXTENSION", "") not in ("", "0"):
        return False
    if hasattr(torch.ops, "pagedllm") and hasattr(torch.ops.pagedllm, "argmax_rows"):
        return True
    max_isa()  # an unknown cap is the user's error to see, not a failed build
    try:
        torch.ops.load_library(str(build_extension()))
        return True
    except Exception as exc:  # any failure means "use the torch path", never a crash
        logger.warning("pagedllm: C++ CPU kernels unavailable (%s); using torch", exc)
        return False


def build_status() -> str:
    """The kernel library in words: where it is and how many compiler warnings its build
    gave, or why there is none."""
    if os.environ.get("PAGEDLLM_NO_EXTENSION", "") not in ("", "0"):
        return "disabled (PAGEDLLM_NO_EXTENSION): torch paths"
    if not load_library():
        return "unavailable (the build failed; see the log): torch paths"
    path = build_extension()
    log = path.with_suffix(".log")
    warnings = log.read_text().count("warning:") if log.exists() else 0
    cap = max_isa()
    capped = f", capped at {cap}" if cap else ""
    return f"{path} ({warnings} compiler warnings{capped})"


def build_extension(directory: Path | None = None) -> Path:
    """Compile the ``csrc/*.cpp`` kernels into one shared library; returns its path.

    The file name carries a hash of the source, the flags, the torch version and the CPU's
    feature flags, so a cached build is reused only where it is valid.
    """
    compiler = os.environ.get("CXX", "g++")
    flags = [
        "-O3",
        # No a*b+c fused into one rounding: the layer ops must round where torch rounds.
        "-ffp-contract=off",
        "-march=native",
        *cap_switches(),
        "-std=c++20",
        "-fPIC",
        "-fopenmp",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        *WARNINGS,
    ]
    parts = [src.read_bytes() for src in (*SOURCES, *HEADERS)]
    parts += [" ".join(flags).encode(), torch.__version__.encode(), cpu_flags_line().encode()]
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"pagedllm_cpu_{digest}.so"
    if target.exists():
        # Marks it used: pruning keeps the most recently used builds, so a checkout that
        # keeps loading its build is not evicted by others' newer ones.
        with contextlib.suppress(OSError):
            os.utime(target)
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Imported only to compile: setuptools under it costs every process ~150 ms and 4 MiB.
    from torch.utils import cpp_extension

    torch_lib = cpp_extension.library_paths()[0]
    # torch's headers as system headers: warnings are for our own code.
    includes = [f"-isystem{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{torch_lib}"]
    with tempfile.TemporaryDirectory(dir=directory) as work:
        objects = [Path(work) / f"{src.stem}.o" for src in SOURCES]
        jobs = [
            [compiler, *flags, *includes, "-c", str(src), "-o", str(obj)]
            for src, obj in zip(SOURCES, objects)
        ]
        # One translation unit per core at a time.
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            logs = list(pool.map(_run, jobs))
        # Link into a private file, then rename: concurrent builders never see half a library.
        tmp = Path(work) / target.name
        logs.append(
            _run([compiler, "-shared", "-fopenmp", *map(str, objects), *libs, "-o", str(tmp)])
        )
        warnings = "".join(logs)
        if warnings:
            logger.info("pagedllm: compiler warnings building the kernels:\n%s", warnings[-4000:])
        target.with_suffix(".log").write_text(warnings)
        os.replace(tmp, target)
    prune_builds(directory, keep=KEPT_BUILDS)
    return target


def _run(cmd: list[str]) -> str:
    """Runs one compiler command; returns what it printed (warnings), raises if it failed."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed: {proc.stderr[-2000:]}")
    return proc.stderr


# Our code builds without warnings under these. GCC 12's own AVX-512 headers trip the
# uninitialized checks (its _mm512_undefined_* idiom), and std::vector<__m512> drops the
# vector type's alignment attribute in the template argument (the heap keeps 64 bytes).
WARNINGS = (
    "-Wall",
    "-Wextra",
    "-Wno-uninitialized",
    "-Wno-maybe-uninitialized",
    "-Wno-ignored-attributes",
)

# Builds kept in the cache directory: each source change makes a new one (and another
# checkout or torch version may still use an older one, so not just the newest).
KEPT_BUILDS = 4


def prune_builds(directory: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` most recently built or used libraries in ``directory``
    (their mtime: ``build_extension`` touches a build it reuses); returns what was deleted.
    A process that loaded a deleted library keeps its mapping."""
    builds = []
    for path in directory.glob("pagedllm_cpu_*.so"):
        with contextlib.suppress(OSError):  # another process removed it first
            builds.append((path.stat().st_mtime, path))
    builds.sort()
    removed = []
    for _, path in builds[: max(0, len(builds) - keep)]:
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            path.with_suffix(".log").unlink(missing_ok=True)
    return removed
