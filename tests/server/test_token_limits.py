"""One fit rule and one ``max_tokens`` default, both the scheduler's: the server asks the
core for its limit (``Scheduler.max_num_tokens``) and never restates the rule."""

from __future__ import annotations

import ast
from pathlib import Path

import pagedllm

from .conftest import wait_pool_free

BLOCK = 4096  # FakeModelRunner's kv_block_bytes
SRC = Path(pagedllm.__file__).parent


def _ask(max_tokens, num_prompt):
    return {"prompt": [ord("a")] * num_prompt, "max_tokens": max_tokens, "temperature": 0}


def test_a_request_at_the_schedulers_limit_is_admitted_and_one_more_is_a_400(make_harness):
    # After a shrink the cache, not max_model_len, bounds a request: 8 blocks of 4 hold
    # 32 tokens, and the last sampled token is never written, so 33 fit.
    h = make_harness(num_blocks=64, block_size=4, max_model_len=128)

    async def body(client):
        shrink = await client.post("/v1/cache/resize", json={"kv_cache_memory": 8 * BLOCK})
        assert shrink.status_code == 200, shrink.text
        assert shrink.json()["blocks_after"] == 8
        limit = h.llm.scheduler.max_num_tokens()
        assert limit == 33
        ok = await client.post("/v1/completions", json=_ask(3, limit - 3))
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["finish_reason"] == "length"
        over = await client.post("/v1/completions", json=_ask(4, limit - 3))
        assert over.status_code == 400, over.text
        error = over.json()["error"]
        assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
        assert str(limit) in error["message"]
        # The default is the room the prompt leaves, as the scheduler fills it in.
        filled = await client.post("/v1/completions", json=_ask(None, limit - 5))
        assert filled.status_code == 200, filled.text
        assert filled.json()["usage"]["completion_tokens"] == 5
        await wait_pool_free(h.engine, llm=h.llm)

    h.run(body)


def test_the_max_tokens_default_is_computed_only_by_the_scheduler():
    """No module outside ``core/scheduler.py`` subtracts a prompt's length from a limit
    to make a ``max_tokens``: ``with_max_tokens`` is called with the scheduler's answer."""
    callers = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "with_max_tokens":
                callers.append((path.relative_to(SRC).as_posix(), ast.unparse(node.args[0])))
    assert sorted(callers) == [
        ("core/scheduler.py", "default"),
        ("engine/llm_engine.py", "self.scheduler.default_max_tokens(num_prompt_tokens)"),
    ]
