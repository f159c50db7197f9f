"""Tokenizers for reading request logs (``planner/cachelog.py``'s ``Tokenizer`` Protocol) and
for decoding beside a server: Hugging Face's behind the Protocol, a decode-only copy of a
fast tokenizer's backend, and a model directory's tokenizer loaded when first needed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


class HFTokenizer:
    """``Tokenizer`` over a Hugging Face tokenizer, encoding as ``pagedllm serve`` does:
    a prompt with special tokens added, a chat rendered by the template without them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(list(texts))["input_ids"]]

    def encode_chats(self, conversations: Sequence[Sequence[Mapping[str, Any]]]) -> list[list[int]]:
        texts = [self.render_chat(c) for c in conversations]
        batch = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [list(ids) for ids in batch]

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the model's tokenizer has no chat template: give prompts instead")
        try:
            return self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja templates raise anything (e.g. role order rules)
            raise ValueError(f"the chat template refused the messages: {exc}") from None

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))


class DecodeOnlyTokenizer:
    """Decoding from a private copy of a fast tokenizer's ``tokenizers`` backend: a thread
    that decodes beside a server's own tokenizer must not share its Rust object (an encode
    there borrows it mutably)."""

    def __init__(self, hf_tokenizer: Any) -> None:
        from tokenizers import Tokenizer as RawTokenizer

        self._decoder = RawTokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())

    def encode_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        raise ValueError("this tokenizer only decodes")

    def encode_chats(self, conversations: Sequence[Sequence[Mapping[str, Any]]]) -> list[list[int]]:
        raise ValueError("this tokenizer only decodes")

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._decoder.decode(list(token_ids), skip_special_tokens=False)


class ModelTokenizer:
    """The tokenizer of a model directory, loaded when first needed: decoding reads
    ``tokenizer.json`` with ``tokenizers`` alone; encoding loads the Hugging Face
    tokenizer (and its chat template), so a token-id log never imports transformers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._hf: HFTokenizer | None = None
        self._decoder: Any = None

    def encode_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        return self._encoder().encode_prompts(texts)

    def encode_chats(self, conversations: Sequence[Sequence[Mapping[str, Any]]]) -> list[list[int]]:
        return self._encoder().encode_chats(conversations)

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._hf is not None:
            return self._hf.decode(token_ids)
        if self._decoder is None:
            file = self.path / "tokenizer.json"
            if not file.is_file():
                return self._encoder().decode(token_ids)
            from tokenizers import Tokenizer as RawTokenizer

            self._decoder = RawTokenizer.from_file(str(file))
        return self._decoder.decode(list(token_ids), skip_special_tokens=False)

    def _encoder(self) -> HFTokenizer:
        if self._hf is None:
            from pagedllm.model.hf_tokenizer import load_hf_tokenizer

            self._hf = HFTokenizer(load_hf_tokenizer(str(self.path)))
        return self._hf


def load_text_tokenizer(model: str) -> ModelTokenizer:
    """The tokenizer of ``model`` ('default' or a Hugging Face directory); no model hub.
    ``ValueError`` when ``model`` is neither."""
    from pagedllm.model.default_model import ensure_default_model

    path = ensure_default_model() if model == "default" else Path(model)
    if not Path(path).is_dir():
        raise ValueError(f"--model {model}: not a model directory (or 'default')")
    return ModelTokenizer(Path(path))


class DeferredTokenizer:
    """A Hugging Face tokenizer loaded on its first use (``load()``), whose EOS id is known
    without it: the engine core beside a server. The server holds its own tokenizer and
    does the text work (prompts arrive as token ids; outputs and stop strings are built
    there), so the core needs only the EOS id, and a tokenizer for nothing but a
    structured-output grammar: Gemma 3's 262k-token one is ~125 MiB resident, beside a
    model of 237. Any other attribute is the loaded tokenizer's (loaded once, under a
    lock: grammars compile in worker threads)."""

    def __init__(self, load: Callable[[], Any], eos_token_id: int | None) -> None:
        self.eos_token_id = eos_token_id
        self._load = load
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def tokenizer(self) -> Any:
        """The tokenizer, loaded now if it was not."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._load()
            return self._tokenizer

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never load for a lookup of this class's own state
            raise AttributeError(name)
        return getattr(self.tokenizer(), name)
