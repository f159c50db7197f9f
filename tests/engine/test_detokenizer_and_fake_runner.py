"""The incremental detokenizer, and the fake runner's own paging checks."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm.core.outputs import ScheduledSequence, SchedulerOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.worker.fake_runner import FakeModelRunner, InjectedFailure, PagingError


def feed(tokenizer: Any, text: str, **kw: Any) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: "), **kw)
    shown = []
    for token in tokenizer.encode(text):
        if detok.add_tokens([token]) is not None:
            break
        shown.append(detok.visible_text)
    detok.finish()
    return detok, shown


def test_multibyte_characters_are_never_shown_half_done(tokenizer: Any) -> None:
    text = "héllo wörld ✓ 日本"
    detok, shown = feed(tokenizer, text)
    assert detok.text == text
    assert not any("\ufffd" in s for s in shown)
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:]))


def test_stop_string_split_over_tokens_and_characters(tokenizer: Any) -> None:
    detok, shown = feed(tokenizer, "abc ✓✓ def", stop=["✓✓", "zz"])
    assert detok.text == "abc " and detok.stop_reason == "✓✓"
    assert all(s in ("", "a", "ab", "abc", "abc ") for s in shown)
    detok, _ = feed(tokenizer, "abc ✓✓ def", stop=["✓✓"], include_stop_str_in_output=True)
    assert detok.text == "abc ✓✓"
    # The earliest stop string wins, whichever is listed first.
    detok, _ = feed(tokenizer, "one two three", stop=["three", "two"])
    assert detok.text == "one " and detok.stop_reason == "two"


def test_special_tokens_skipped_or_kept(tokenizer: Any) -> None:
    ids = tokenizer.encode("hi") + [tokenizer.eos_token_id]
    skip = IncrementalDetokenizer(tokenizer, [1])
    keep = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False)
    for detok in (skip, keep):
        detok.add_tokens(ids)
        detok.finish()
    assert skip.text == "hi" and keep.text == "hi<|endoftext|>"


def seq(rid: str, tokens: list[int], start: int, table: list[int], prompt: list[int], out=()):
    return ScheduledSequence(rid, tuple(tokens), start, tuple(table), 1, None, prompt, list(out))


def test_fake_runner_reads_context_back_through_the_block_table() -> None:
    runner = FakeModelRunner(8, 2, num_host_blocks=2)
    prompt = [5, 6, 7]
    out = runner.execute(SchedulerOutput(scheduled=(seq("a", prompt, 0, [3, 1], prompt),)))
    token = out.sampled_token_ids[0][0]
    assert token == runner.next_token(prompt)
    # A wrong table (block 2 instead of 1) reads the wrong slots: caught at once.
    with pytest.raises(PagingError):
        runner.execute(SchedulerOutput(scheduled=(seq("a", [token], 3, [3, 2], prompt, [token]),)))
    # Swap out, clobber the device block, swap back in: the context survives.
    runner.execute(SchedulerOutput(swap_out=((1, 0),)))
    runner.execute(SchedulerOutput(scheduled=(seq("x", [9, 9], 0, [1], [9, 9]),)))
    runner.execute(SchedulerOutput(swap_in=((0, 4),)))
    good = seq("a", [token], 3, [3, 4], prompt, [token])
    assert runner.execute(SchedulerOutput(scheduled=(good,))).sampled_token_ids[0] == (
        runner.next_token([*prompt, token]),
    )
    runner.fail_request_ids.add("a")
    with pytest.raises(InjectedFailure, match="'a'"):
        runner.execute(SchedulerOutput(scheduled=(good,)))
