"""The disk tier under the prefix cache, on the fake runner (its strict mode raises when
the context read back through a block table is not the sequence's tokens, so a block
loaded wrong cannot go unnoticed) and on a tiny random Llama (K/V bit-identical)."""

from __future__ import annotations

import hashlib
import os
import random
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedllm.core.hashing import hash_request_blocks
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from tests.engine.conftest import run_all

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BS = 4


def conversation(seed: int, length: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 30) for _ in range(length)]


def ask(engine: LLMEngine, request_id: str, prompt: list[int], salt: str | None = None):
    engine.add_request(request_id, prompt, GREEDY, cache_salt=salt)
    return run_all(engine)[request_id]


def history_and_next(engine: LLMEngine, seed: int) -> tuple[list[int], list[int]]:
    """A first turn, then the prompt of the second (history + reply + new message)."""
    first = conversation(seed)
    out = ask(engine, f"c{seed}-1", first)
    return first, first + list(out.outputs[0].token_ids) + conversation(seed + 100, 5)


def history_blocks_tokens(second: list[int]) -> int:
    """Tokens in the full blocks of the first turn's cache: the prompt and every generated
    token but the last, which was sampled, never fed back."""
    return (len(second) - 5 - 1) // BS * BS


def block_files(path: Path) -> list[Path]:
    return sorted(path.glob("blocks/*/*.kv"))


@pytest.fixture
def tier_engine(fake_engine: Callable[..., LLMEngine], tmp_path: Path) -> Callable[..., LLMEngine]:
    """A fake-runner engine with a small pool (about one conversation) and a disk tier."""

    def build(num_blocks: int = 16, path: Path | None = None, **config) -> LLMEngine:
        return fake_engine(
            num_blocks=num_blocks,
            block_size=BS,
            kv_offload_dir=str(path or tmp_path / "kv"),
            max_model_len=60,
            **config,
        )

    return build


def evict_everything(engine: LLMEngine) -> None:
    engine.flush_disk_tier()
    engine.kv.evict_cached_blocks()


def test_a_returning_conversation_loads_its_history_from_disk(
    tier_engine: Callable[..., LLMEngine], fake_engine: Callable[..., LLMEngine]
) -> None:
    engine = tier_engine()
    _, second = history_and_next(engine, 1)
    evict_everything(engine)
    out = ask(engine, "c1-2", second)
    # Every full block of the history (prompt and generated tokens) came from disk.
    assert out.num_cached_tokens == history_blocks_tokens(second)
    stats = engine.get_stats()
    assert stats.cache.prefix_disk_hits_tokens == out.num_cached_tokens
    assert stats.disk.blocks_read == out.num_cached_tokens // BS
    plain = fake_engine(num_blocks=64, block_size=BS, max_model_len=60)
    assert out.outputs[0].token_ids == ask(plain, "p", second).outputs[0].token_ids


def test_after_a_restart_the_first_request_finds_its_whole_history(
    tier_engine: Callable[..., LLMEngine], tmp_path: Path
) -> None:
    engine = tier_engine()
    _, second = history_and_next(engine, 2)
    expected = ask(engine, "again", second).outputs[0].token_ids
    engine.close()
    restarted = tier_engine()
    out = ask(restarted, "c2-2", second)
    assert out.num_cached_tokens == (len(second) - 1) // BS * BS
    assert out.outputs[0].token_ids == expected


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "swap-names"])
def test_a_damaged_block_file_is_recomputed_with_the_same_output(
    tier_engine: Callable[..., LLMEngine], tmp_path: Path, damage: str
) -> None:
    engine = tier_engine()
    _, second = history_and_next(engine, 3)
    expected = ask(engine, "again", second).outputs[0].token_ids
    engine.close()
    hashes = hash_request_blocks(second, BS)
    victim = tmp_path / "kv" / "blocks" / hashes[3].hex()[:2] / f"{hashes[3].hex()}.kv"
    data = victim.read_bytes()
    if damage == "flip":
        victim.write_bytes(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])
    elif damage == "truncate":
        victim.write_bytes(data[:-5])
    elif damage == "delete":
        victim.unlink()
    else:  # another block's valid file under this block's name
        other = tmp_path / "kv" / "blocks" / hashes[4].hex()[:2] / f"{hashes[4].hex()}.kv"
        victim.write_bytes(other.read_bytes())
    restarted = tier_engine()
    out = ask(restarted, "c3-2", second)
    assert out.outputs[0].token_ids == expected
    # Blocks 0-2 are good; from the damaged block 3 on, the history is recomputed.
    assert out.num_cached_tokens == 3 * BS
    stats = restarted.get_stats().disk
    assert stats.misses_corrupt == (0 if damage == "delete" else 1)
    restarted.flush_disk_tier()
    assert victim.read_bytes() == data  # the damaged file was deleted, then stored anew
    again = ask(restarted, "c3-3", second)
    assert again.outputs[0].token_ids == expected


def test_a_store_of_another_model_is_refused(
    tier_engine: Callable[..., LLMEngine], fake_engine: Callable[..., LLMEngine], tmp_path: Path
) -> None:
    tier_engine().close()
    with pytest.raises(ValueError, match="another model or KV layout.*block_size"):
        fake_engine(num_blocks=16, block_size=8, kv_offload_dir=str(tmp_path / "kv"))
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and holds no pagedllm KV store"):
        tier_engine(path=foreign)


STORE_DAMAGE = {
    "bit-flip": lambda data: bytes([data[0] ^ 1]) + data[1:],
    "torn": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
    "garbage": lambda data: bytes(range(256)),
    "not-an-object": lambda data: b"[]",
}


@pytest.mark.parametrize("damage", sorted(STORE_DAMAGE))
def test_a_damaged_store_file_is_set_aside_and_the_cache_starts_empty(
    tier_engine: Callable[..., LLMEngine],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    damage: str,
) -> None:
    engine = tier_engine()
    history_and_next(engine, 5)
    engine.close()
    root = tmp_path / "kv"
    old_blocks = block_files(root)
    meta = root / "store.json"
    meta.write_bytes(STORE_DAMAGE[damage](meta.read_bytes()))
    with caplog.at_level("WARNING", logger="pagedllm.worker.disk_store"):
        restarted = tier_engine()
    [aside] = tmp_path.glob("kv.damaged-*")
    assert str(aside) in caplog.text and "store.json" in caplog.text
    assert [p.name for p in block_files(aside)] == [p.name for p in old_blocks]
    assert block_files(root) == []
    assert restarted.get_stats().disk.stores_set_aside == 1
    # The new store works: a returning conversation finds its history on disk.
    _, second = history_and_next(restarted, 6)
    evict_everything(restarted)
    assert ask(restarted, "c6-2", second).num_cached_tokens == history_blocks_tokens(second)
    restarted.close()
    assert tier_engine().get_stats().disk.stores_set_aside == 0


def test_a_damaged_store_file_in_a_directory_not_ours_is_refused(
    tier_engine: Callable[..., LLMEngine], tmp_path: Path
) -> None:
    foreign = tmp_path / "other"
    (foreign / "blocks" / "ab").mkdir(parents=True)
    (foreign / "store.json").write_bytes(b"")
    (foreign / "blocks" / "ab" / f"{'ab' * 32}.kv").write_bytes(b"not a kv block")
    with pytest.raises(ValueError, match="kv_offload_dir: cannot read .*store.json"):
        tier_engine(path=foreign)
    (foreign / "blocks" / "ab" / f"{'ab' * 32}.kv").unlink()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="kv_offload_dir: cannot read .*store.json"):
        tier_engine(path=foreign)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_a_crash_while_writing_the_store_file_leaves_the_old_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from pagedllm.worker import disk_store

    meta = tmp_path / "store.json"
    meta.write_text("old")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))

    def crash(src: object, dst: object) -> None:
        raise OSError("power lost")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power lost"):
        disk_store.write_durably(meta, b"new")
    assert meta.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["store.json"]  # no temporary left
    assert len(synced) == 1  # the new file's bytes reached the disk before the rename
    monkeypatch.undo()
    synced.clear()
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    disk_store.write_durably(meta, b"new")
    assert meta.read_text() == "new" and len(synced) == 2  # the file, then the directory


def test_the_store_is_private_and_named_by_hashes_only(
    tier_engine: Callable[..., LLMEngine], tmp_path: Path
) -> None:
    engine = tier_engine()
    history_and_next(engine, 4)
    engine.flush_disk_tier()
    root = tmp_path / "kv"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    files = block_files(root)
    assert files
    for path in [*files, root / "store.json"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for path in files:
        assert len(path.stem) == 64 and int(path.stem, 16) >= 0


def test_tenants_never_read_each_others_blocks(tier_engine: Callable[..., LLMEngine]) -> None:
    engine = tier_engine()
    prompt = conversation(5)
    ask(engine, "a1", prompt, salt="tenant-a")
    evict_everything(engine)
    assert ask(engine, "b1", prompt, salt="tenant-b").num_cached_tokens == 0
    evict_everything(engine)
    assert ask(engine, "a2", prompt, salt="tenant-a").num_cached_tokens > 0


def test_the_byte_budget_keeps_the_most_recently_used_blocks(
    tier_engine: Callable[..., LLMEngine], tmp_path: Path
) -> None:
    file_nbytes = 104 + 8 * BS + 8 * BS
    engine = tier_engine(kv_offload_size=12 * file_nbytes)
    assert engine.kv.disk.capacity == 12
    for seed in (6, 7, 8):
        ask(engine, f"s{seed}", conversation(seed))
    engine.flush_disk_tier()
    assert len(block_files(tmp_path / "kv")) == len(engine.kv.disk) == 12
    # The least recently used go first: the last conversation's blocks are all kept.
    last = {h.hex() for h in hash_request_blocks(conversation(8), BS)}
    assert last <= {p.stem for p in block_files(tmp_path / "kv")}


def test_the_prefix_lookup_has_no_side_effect(tier_engine: Callable[..., LLMEngine]) -> None:
    engine = tier_engine()
    _, second = history_and_next(engine, 9)
    evict_everything(engine)
    from pagedllm.core.request import Request

    order = engine.kv.disk.hashes()
    hit = engine.kv.get_computed_blocks(Request("probe", second))
    assert hit.num_disk_blocks > 0 and not hit.block_ids
    assert engine.kv.disk.hashes() == order
    assert not engine.kv.take_disk_ops()
    engine.kv.free(Request("probe", second))


@pytest.mark.parametrize(
    ("kv_cache_dtype", "first_block"),
    [("auto", None), ("int8", None), ("int8", True), ("int4", None), ("int4", False),
     ("fp8_e4m3", None)],
)  # fmt: skip
def test_torch_runner_restores_kv_bit_identical(
    model_engine: Callable[..., LLMEngine],
    tmp_path: Path,
    kv_cache_dtype: str,
    first_block: bool | None,
) -> None:
    # A quantized cache's blocks go to disk with their scales (and minimums), an
    # unquantized first block (int4's default) as its full-precision rows; read back, data,
    # scales, staged rows and the tokens that follow are what the engine had before.
    def kv_digest(engine: LLMEngine, block_ids: list[int]) -> str:
        rows = engine.runner.kv_cache.read_blocks(block_ids)
        return hashlib.sha256(b"".join(row.tobytes() for row in rows)).hexdigest()

    common = dict(
        block_size=BS,
        num_blocks=64,
        max_model_len=64,
        dtype="bfloat16",
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_unquantized_first_block=first_block,
    )
    engine = model_engine(kv_offload_dir=str(tmp_path / "kv"), **common)
    prompt = conversation(10, 33)
    engine.add_request("w", prompt, GREEDY)
    engine.step()  # the prompt computed, its blocks registered
    request = engine.scheduler.requests["w"]
    written = kv_digest(engine, engine.kv.block_table("w")[:8])
    run_all(engine)
    assert request.num_computed_tokens > 32
    expected = ask(engine, "again", prompt).outputs[0].token_ids
    engine.close()
    restarted = model_engine(kv_offload_dir=str(tmp_path / "kv"), **common)
    restarted.add_request("r", prompt, GREEDY)
    restarted.step()
    assert restarted.scheduler.requests["r"].num_cached_tokens == 32
    assert kv_digest(restarted, restarted.kv.block_table("r")[:8]) == written
    first = restarted.kv.block_table("r")[0]
    kept = restarted.config.unquantized_first_block
    assert kept == (kv_cache_dtype == "int4" if first_block is None else first_block)
    assert (first in getattr(restarted.runner.kv_cache, "_slot_of", {})) == kept
    assert run_all(restarted)["r"].outputs[0].token_ids == expected
    if kv_cache_dtype != "auto":  # the first block's layout is part of the store's identity
        with pytest.raises(ValueError, match="another model or KV layout.*first_block"):
            flipped = {**common, "kv_cache_unquantized_first_block": not kept}
            model_engine(kv_offload_dir=str(tmp_path / "kv"), **flipped)
    # The first difference found is named: the weights' dtype, or (float K/V) the K/V dtype.
    named = "kv_dtype" if kv_cache_dtype == "auto" else "weights"
    with pytest.raises(ValueError, match=f"another model or KV layout.*{named}"):
        model_engine(kv_offload_dir=str(tmp_path / "kv"), **{**common, "dtype": "float32"})
    other = "int8" if kv_cache_dtype == "auto" else "auto"
    with pytest.raises(ValueError, match="another model or KV layout"):
        other_dtype = {**common, "kv_cache_dtype": other, "kv_cache_unquantized_first_block": None}
        model_engine(kv_offload_dir=str(tmp_path / "kv"), **other_dtype)
    assert os.listdir(tmp_path / "kv")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_bytes_fast_path_matches_the_reference(dtype: str) -> None:
    import numpy as np
    import torch

    from pagedllm.worker.kv_cache import (
        KVCache,
        KVCacheSpec,
        read_blocks_reference,
        write_blocks_reference,
    )

    spec = KVCacheSpec(3, 2, 8, 4, getattr(torch, dtype))
    kv, twin = KVCache(spec, 10), KVCache(spec, 10)
    for k, v in kv.device_caches:
        k.normal_()
        v.normal_()
    ids = [7, 2, 9]
    data = kv.read_blocks(ids)
    assert data.shape == (3, spec.bytes_per_block) and data.dtype == np.uint8
    assert np.array_equal(data, read_blocks_reference(kv.device_tensors, ids))
    kv.write_blocks([0, 1, 4], data)
    write_blocks_reference(twin.device_tensors, [0, 1, 4], data)
    for (k, v), (tk, tv) in zip(kv.device_caches, twin.device_caches, strict=True):
        assert torch.equal(k[[0, 1, 4]], k[ids]) and torch.equal(v[[0, 1, 4]], v[ids])
        assert torch.equal(tk[[0, 1, 4]], k[ids]) and torch.equal(tv[[0, 1, 4]], v[ids])


def _benchmark():
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "multi_turn.py"
    spec = importlib.util.spec_from_file_location("bench_multi_turn", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _last_json(capsys) -> dict:
    import json

    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_benchmark_trace_mode_on_the_fixture(capsys) -> None:
    trace = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_head.jsonl"
    args = ["--trace", str(trace), "--trace-pool-blocks", "64", "--trace-disk-blocks", "0,64,4096"]
    assert _benchmark().main(args) == 0
    rows = _last_json(capsys)["rows"]
    for row in rows:
        assert row["ram_hit"] + row["disk_hit"] + row["miss"] == pytest.approx(1.0)
    assert rows[0]["disk_hit"] == 0.0
    assert rows[0]["ram_hit"] == rows[1]["ram_hit"] == rows[2]["ram_hit"]
    assert rows[0]["miss"] >= rows[1]["miss"] > rows[2]["miss"]
    assert rows[2]["disk_hit"] > 0.05  # a big disk tier keeps what the pool lost


def test_benchmark_multi_turn_smoke(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    args = [
        "--model", str(tiny_model_dir), "--dtype", "float32", "--block-size", "4",
        "--users", "3", "--rounds", "3", "--system-len", "12", "--message-len", "4:12",
        "--max-tokens", "4", "--pool-conversations", "1", "--restart-after-round", "2",
        "--offload-dir", str(tmp_path), "--num-threads", "1",
    ]  # fmt: skip
    assert _benchmark().main(args) == 0
    result = _last_json(capsys)
    assert result["on"]["same_outputs_as_off"] and result["big"]["same_outputs_as_off"]
    for name in ("off", "on", "big"):
        shares = result[name]["shares"]
        assert shares["ram"] + shares["disk"] + shares["recomputed"] == pytest.approx(1.0)
    assert result["on"]["shares"]["disk"] > 0
    assert result["on"]["shares"]["recomputed"] == 0.0
    restart = result["on"]["restart"]
    assert restart["cached_tokens"] == restart["history_tokens"] > 0
