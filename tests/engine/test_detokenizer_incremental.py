"""The incremental detokenizer against a full decode, on random token sequences."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from pagedllm.engine import detokenizer as detok_module
from pagedllm.engine.detokenizer import IncrementalDetokenizer

_SMOLLM = Path.home() / ".cache" / "pagedllm" / "SmolLM2-135M-Instruct"


def check_against_full_decode(
    tokenizer: Any, vocab: int, seed: int, skip_special_tokens: bool = True
) -> None:
    """At every step the text is the full decode less a trailing run of U+FFFD (bytes
    still waiting for the rest of their character); after ``finish`` it is all of it."""
    rng = random.Random(seed)
    # A prompt of whole characters: output bytes can't complete a prompt character.
    prompt = tokenizer.encode("a prompt: ")[: rng.randrange(0, 8)]
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    output: list[int] = []
    for _ in range(rng.randrange(1, 80)):
        output.append(rng.randrange(vocab))
        detok.add_tokens(output[-1:])
        assert_decode_less_waiting_bytes(detok, tokenizer, output, skip_special_tokens, seed)
    assert detok.finish() == tokenizer.decode(output, skip_special_tokens=skip_special_tokens)


def assert_decode_less_waiting_bytes(
    detok: IncrementalDetokenizer,
    tokenizer: Any,
    output: list[int],
    skip_special_tokens: bool,
    seed: int,
) -> None:
    """The text is the full decode less a trailing run of U+FFFD."""
    full = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
    if not full.endswith("\ufffd"):
        assert detok.text == full, (seed, output)
    else:
        assert full.startswith(detok.text), (seed, output)
        assert set(full[len(detok.text) :]) == {"\ufffd"}, (seed, output)


def check_lazy_against_full_decode(tokenizer: Any, vocab: int, seed: int) -> None:
    """Tokens added in random runs, each decoded as one window, the text read at random
    moments: the same contract as token by token."""
    rng = random.Random(seed)
    prompt = tokenizer.encode("a prompt: ")[: rng.randrange(0, 8)]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    output: list[int] = []
    for _ in range(rng.randrange(1, 30)):
        run = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        output += run
        detok.add_tokens(run, one_window=True)
        if rng.random() < 0.5:
            assert_decode_less_waiting_bytes(detok, tokenizer, output, True, seed)
    assert detok.finish() == tokenizer.decode(output, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(30))
def test_lazy_runs_match_full_decode(tokenizer: Any, seed: int) -> None:
    check_lazy_against_full_decode(tokenizer, 256, seed)


def test_lazy_is_ignored_with_stop_strings(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], stop=("b",))
    assert detok.add_tokens(tokenizer.encode("aab"), one_window=True) == "b"
    assert detok.text == "aa"


class DecodeOnly:
    """Just ``decode``: the detokenizer can't take the Rust backend's shortcut."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = tokenizer.decode
        self.encode = tokenizer.encode


@pytest.mark.parametrize("backend", [True, False])
@pytest.mark.parametrize("seed", range(30))
def test_random_bytes_match_full_decode(tokenizer: Any, seed: int, backend: bool) -> None:
    # Ids 0..255 are raw bytes: random ids split UTF-8 characters and make invalid ones.
    check_against_full_decode(tokenizer if backend else DecodeOnly(tokenizer), 256, seed)


def test_backend_shortcut_is_taken_only_for_plain_fast_tokenizers(tokenizer: Any) -> None:
    assert detok_module._backend_decoder(tokenizer) is not None
    assert detok_module._backend_decoder(DecodeOnly(tokenizer)) is None


def test_utf8_heavy_bytes_match_full_decode(tokenizer: Any) -> None:
    # Mostly lead and continuation bytes, so most characters span several tokens.
    text = "héllo ✓ 日本語 🙂 ok"
    ids = list(text.encode())
    detok = IncrementalDetokenizer(tokenizer, [])
    for i, token in enumerate(ids):
        detok.add_tokens([token])
        assert "\ufffd" not in detok.text
        assert text.encode().startswith(detok.text.encode()), i
    assert detok.finish() == text


def test_one_decode_per_token(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = tokenizer.decode

    def counting_decode(*args: Any, **kwargs: Any) -> str:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", counting_decode)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: "))
    ids = tokenizer.encode("plain ascii text, one token per byte " * 4)
    for token in ids:
        detok.add_tokens([token])
    # One decode per token, plus one per window move and the first prefix decode:
    # fewer than the two per token of decoding the prefix and the whole window.
    moves = len(ids) // (detok_module._MAX_WINDOW - detok_module._MOVE_CONTEXT) + 2
    assert len(calls) <= len(ids) + moves < 2 * len(ids)
    assert detok.finish() == "plain ascii text, one token per byte " * 4


@pytest.fixture(scope="module")
def smollm_tokenizer() -> Any:
    if not (_SMOLLM / "tokenizer.json").exists():
        pytest.skip("SmolLM2-135M-Instruct tokenizer not cached")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_SMOLLM))


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_default_model_tokenizer_matches_full_decode(
    smollm_tokenizer: Any, seed: int, skip_special_tokens: bool
) -> None:
    check_against_full_decode(smollm_tokenizer, len(smollm_tokenizer), seed, skip_special_tokens)
