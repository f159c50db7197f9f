"""Both managers provide what the scheduler needs of one, and the scheduler asks for
nothing else."""

import ast
import inspect

from pagedllm.core import inflight, multi_step, request_fit, scheduler, step_batch
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


def kv_attributes(module) -> set[str]:
    """Attributes read from ``kv`` or ``self.kv`` in ``module``."""
    used = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        if (isinstance(value, ast.Name) and value.id == "kv") or (
            isinstance(value, ast.Attribute) and value.attr == "kv"
        ):
            used.add(node.attr)
    return used


def test_scheduler_uses_only_the_protocol():
    for module in (scheduler, request_fit, inflight, step_batch, multi_step):
        used = kv_attributes(module)
        assert used, f"{module.__name__} reaches its manager through kv"
        assert used <= protocol_members(), (module.__name__, used - protocol_members())
