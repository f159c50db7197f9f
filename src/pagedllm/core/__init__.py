"""The paged KV core: pure Python (no torch, numpy or transformers).

Block identity, the block pool, the KV cache manager, the contiguous baseline,
waste accounting and the scheduler all live here. A test imports this package in
a fresh interpreter and checks that torch was not imported.
"""
