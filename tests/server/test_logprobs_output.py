"""The OpenAI logprobs the server writes from vLLM-shaped positions: the top ``k`` asked
for, most likely first, whether or not the actual token is among them."""

from __future__ import annotations

from typing import Any

from pagedllm.core.outputs import TokenLogprob
from pagedllm.engine.outputs import position_logprobs
from pagedllm.server.serving import chat_logprobs, completion_logprobs, echo_logprobs

A, B, C, D = (ord(x) for x in "abcd")  # the byte tokenizer: id == byte
TOP = ((A, B), (-0.1, -2.5))
RECORDS = [
    TokenLogprob(A, -0.1, 1, *TOP),  # the actual token is the most likely
    TokenLogprob(C, -2.5, 2, *TOP),  # tied with the second, not listed: an entry more
    TokenLogprob(D, -9.0, 7, *TOP),  # far outside the top 2
]


def positions(tokenizer: Any) -> list:
    return [position_logprobs(r, tokenizer) for r in RECORDS]


def test_completion_lists_exactly_the_top_k(tokenizer: Any) -> None:
    lp = completion_logprobs(tokenizer, positions(tokenizer), [A, C, D], 2, 5)
    assert lp.tokens == ["a", "c", "d"]
    assert lp.token_logprobs == [-0.1, -2.5, -9.0]
    assert lp.top_logprobs == [{"a": -0.1, "b": -2.5}] * 3
    assert [list(top) for top in lp.top_logprobs] == [["a", "b"]] * 3  # most likely first
    assert lp.text_offset == [5, 6, 7]
    # logprobs=0: only the actual token, no alternatives
    alone = [position_logprobs(TokenLogprob(C, -2.5, 2), tokenizer)]
    assert completion_logprobs(tokenizer, alone, [C], 0, 0).top_logprobs == [{}]


def test_echo_puts_the_prompt_first_with_a_null(tokenizer: Any) -> None:
    prompt = [None, *positions(tokenizer)[:2]]
    lp = echo_logprobs(tokenizer, [D, A, C], prompt, 2, None)
    assert lp.tokens == ["d", "a", "c"] and lp.token_logprobs == [None, -0.1, -2.5]
    assert lp.top_logprobs == [None, {"a": -0.1, "b": -2.5}, {"a": -0.1, "b": -2.5}]


def test_chat_lists_the_top_k_and_no_tokenizer_spells_ids(tokenizer: Any) -> None:
    content = chat_logprobs(tokenizer, positions(tokenizer), [A, C, D], 2).content
    assert [t.token for t in content] == ["a", "c", "d"]
    assert [[x.token for x in t.top_logprobs] for t in content] == [["a", "b"]] * 3
    bare = completion_logprobs(None, positions(None), [A, C, D], 2, 0)
    assert bare.tokens == [f"token_id:{t}" for t in (A, C, D)]
    assert bare.top_logprobs[1] == {f"token_id:{A}": -0.1, f"token_id:{B}": -2.5}
