"""Stop strings on the server path are checked once, in the API process: the core is told
to finish the sequence ("stop"), so it counts as finished, not aborted, and frees its blocks."""

from __future__ import annotations

from .conftest import wait_pool_free, wait_until


def test_a_stop_string_found_in_the_api_process_finishes_the_sequence_in_the_core(make_harness):
    h = make_harness()
    prompt = "tell me"
    full = h.expected_text(prompt, 12)
    stop = full[4:6]
    cut = full.index(stop)

    async def body(client):
        payload = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop]}
        r = await client.post("/v1/completions", json=payload)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == full[:cut] and choice["finish_reason"] == "stop"
        await wait_pool_free(h.engine, llm=h.llm)
        await wait_until(lambda: h.engine.num_in_flight == 0, what="the stream to end")
        stats = await h.engine.get_stats()
        assert stats.num_requests_finished == 1 and stats.num_requests_aborted == 0
        assert stats.num_unfinished_requests == 0

    h.run(body)
