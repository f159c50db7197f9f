import subprocess
import sys

# Import pagedllm.core and every module in it, in a fresh interpreter.
CODE = """
import importlib, pkgutil, sys
import pagedllm.core
names = sorted(m.name for m in pkgutil.iter_modules(pagedllm.core.__path__))
for name in names:
    importlib.import_module("pagedllm.core." + name)
heavy = sorted(m for m in ("torch", "numpy", "transformers") if m in sys.modules)
print(",".join(names))
print(",".join(heavy))
"""


def test_core_imports_no_torch_numpy_or_transformers():
    result = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    names, heavy = result.stdout.splitlines()
    assert {"block_pool", "hashing", "kv_cache_manager", "request"} <= set(names.split(","))
    assert heavy == "", f"pagedllm.core imported {heavy}"
