"""The test tree never shadows an installed distribution.

Under pytest's default import mode (prepend), each test module's first ancestor directory without
an ``__init__.py`` joins ``sys.path``, so every module and package directly inside it is importable
by its bare name. When such a name is also an installed distribution's top-level module, the test
tree's copy wins for every import in the process: transformers 5.25 imports the ``kernels``
distribution, and a ``tests/kernels/`` package on the path broke every checkpoint-building test.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _import_root(directory: Path) -> Path:
    """The directory pytest's prepend mode puts on sys.path for modules in ``directory``."""
    while (directory / "__init__.py").exists():
        directory = directory.parent
    return directory


def exposed_names(tests: Path) -> dict[str, Path]:
    """Top-level import names the test tree puts on sys.path, each with the file or package."""
    names: dict[str, Path] = {}
    for module in sorted(tests.rglob("*.py")):
        root = _import_root(module.parent)
        first = module.relative_to(root).parts[0]
        top = root / first
        names.setdefault(top.stem if top.is_file() else first, top)
    return names


def shadowed(
    exposed: Mapping[str, Path], installed: Mapping[str, list[str]]
) -> list[tuple[str, Path, list[str]]]:
    """(name, test tree path, distributions) for each exposed name an installed one also owns."""
    return [(name, path, installed[name]) for name, path in exposed.items() if name in installed]


def describe(clashes: list[tuple[str, Path, list[str]]]) -> str:
    return "; ".join(
        f"test tree's {path} is importable as '{name}', which installed distribution(s) "
        f"{', '.join(sorted(set(dists)))} also provide"
        for name, path, dists in clashes
    )


def test_test_tree_shadows_no_installed_distribution() -> None:
    clashes = shadowed(exposed_names(TESTS), importlib.metadata.packages_distributions())
    assert not clashes, describe(clashes)


def test_the_tree_exposes_one_package_name() -> None:
    # Every directory of the tree is a package under ``tests``, so ``tests`` is the one name.
    assert set(exposed_names(TESTS)) == {"tests"}


def test_a_bare_test_package_is_reported_with_its_distribution(tmp_path: Path) -> None:
    # The layout that broke: tests/ without __init__.py, tests/kernels/ with one.
    (tmp_path / "tests" / "kernels").mkdir(parents=True)
    (tmp_path / "tests" / "kernels" / "__init__.py").write_text("")
    (tmp_path / "tests" / "kernels" / "test_gemm.py").write_text("")
    (tmp_path / "tests" / "conftest.py").write_text("")
    exposed = exposed_names(tmp_path / "tests")
    assert exposed == {
        "kernels": tmp_path / "tests" / "kernels",
        "conftest": tmp_path / "tests" / "conftest.py",
    }
    clashes = shadowed(exposed, {"kernels": ["kernels"], "torch": ["torch"]})
    assert clashes == [("kernels", tmp_path / "tests" / "kernels", ["kernels"])]
    message = describe(clashes)
    assert "tests/kernels" in message and "'kernels'" in message and "kernels also" in message


def test_a_packaged_tree_exposes_only_its_root(tmp_path: Path) -> None:
    for package in ("tests", "tests/kernels"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "tests" / "kernels" / "test_gemm.py").write_text("")
    assert exposed_names(tmp_path / "tests") == {"tests": tmp_path / "tests"}
    assert shadowed({"tests": tmp_path / "tests"}, {"kernels": ["kernels"]}) == []
