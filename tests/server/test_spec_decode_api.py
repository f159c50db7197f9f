"""Speculative decoding seen from outside: its totals in ``/v1/cache``, ``/metrics`` and
the engine stats that cross the process boundary; the same text with it on and off."""

from __future__ import annotations

from tests.server.test_server_api import _samples

SPEC = {"speculative_config": {"method": "ngram", "prompt_lookup_min": 1, "automatic": False}}


def completion(make_harness, engine_kw):
    h = make_harness(engine_kw=engine_kw)
    seen = {}

    async def body(client):
        r = await client.post(
            "/v1/completions", json={"prompt": "abcabcabc", "max_tokens": 40, "temperature": 0}
        )
        assert r.status_code == 200
        seen["text"] = r.json()["choices"][0]["text"]
        seen["report"] = (await client.get("/v1/cache")).json()
        seen["metrics"] = _samples((await client.get("/metrics")).text)
        seen["stats"] = await h.engine.get_stats()

    h.run(body)
    return seen


def test_drafts_are_counted_in_the_report_metrics_and_stats(make_harness):
    off = completion(make_harness, {})
    on = completion(make_harness, SPEC)
    assert on["text"] == off["text"] and len(on["text"]) == 40
    assert off["report"]["speculative"] is None
    assert not any(name.startswith("pagedllm_spec_decode") for name in off["metrics"])
    spec = on["report"]["speculative"]
    assert spec["method"] == "ngram" and spec["automatic"] is False
    assert spec["verifications"] > 0 and spec["draft_tokens"] >= spec["verifications"]
    assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    expected_length = (spec["accepted_tokens"] + spec["verifications"]) / spec["verifications"]
    assert spec["mean_acceptance_length"] == expected_length
    metrics = on["metrics"]
    assert metrics["pagedllm_spec_decode_num_drafts_total"] == spec["verifications"]
    assert metrics["pagedllm_spec_decode_num_draft_tokens_total"] == spec["draft_tokens"]
    assert metrics["pagedllm_spec_decode_num_accepted_tokens_total"] == spec["accepted_tokens"]
    assert metrics["pagedllm_spec_decode_mean_acceptance_length"] == expected_length
    stats = on["stats"].speculative
    assert stats is not None and stats.num_draft_tokens == spec["draft_tokens"]


def test_a_bad_speculative_config_names_its_key():
    import pytest

    from pagedllm.engine.config import EngineConfig

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"num_speculative_tokens": 99})
