"""Both managers provide what the scheduler needs of one, and the scheduler asks for
nothing else."""

import ast
import inspect

from pagedllm.core import scheduler
from pagedllm.core.hybrid_kv import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_protocol import KVCacheProtocol


def protocol_members() -> set[str]:
    names = set(KVCacheProtocol.__annotations__)
    names.update(n for n in vars(KVCacheProtocol) if not n.startswith("_"))
    return names


def test_both_managers_provide_the_protocol():
    assert isinstance(KVCacheManager(8, 4), KVCacheProtocol)
    assert isinstance(HybridKVCacheManager(8, 4, (None, 8)), KVCacheProtocol)


def test_scheduler_uses_only_the_protocol():
    tree = ast.parse(inspect.getsource(scheduler))
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "kv"
    }
    assert used, "the scheduler reaches its manager through self.kv"
    assert used <= protocol_members(), used - protocol_members()
