from pagedllm.core.hashing import hash_block_tokens, hash_request_blocks


def test_hash_chains_over_parent():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [h0, h1]
    # Same tokens under a different parent are a different block.
    assert hash_block_tokens(None, [5, 6, 7, 8]) != h1


def test_partial_block_has_no_hash():
    assert hash_request_blocks([1, 2, 3], 4) == []
    assert len(hash_request_blocks(list(range(11)), 4)) == 2


def test_extra_keys_separate_tenants():
    plain = hash_block_tokens(None, [1, 2])
    salted = hash_block_tokens(None, [1, 2], ("tenant-a",))
    other = hash_block_tokens(None, [1, 2], ("tenant-b",))
    assert len({plain, salted, other}) == 3
    assert hash_block_tokens(None, [1, 2], ("ab",)) != hash_block_tokens(None, [1, 2], ("a", "b"))


def test_token_boundaries_are_unambiguous():
    assert hash_block_tokens(None, [1, 23]) != hash_block_tokens(None, [12, 3])
    assert hash_block_tokens(None, [256]) != hash_block_tokens(None, [1, 0])
    assert len(hash_block_tokens(None, [0])) == 32
