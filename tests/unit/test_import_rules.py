"""The import rules of docs/architecture.md, checked by reading the source (ast), not by importing it.

Every import counts, wherever it sits (module level, inside a function, under `if TYPE_CHECKING:`): a lazy
import still ties the packages together, and the rules are about the shape of the code, not import time.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

import agentgrad

SRC = Path(agentgrad.__file__).resolve().parent  # src/agentgrad
LEAVES = {"agentgrad.registry"}  # imports nothing of ours, so any package may use it without an arrow back
PURE_CORE = ("agentgrad.algos", "agentgrad.types", "agentgrad.batch")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def imports_of(module: str) -> frozenset[str]:
    """Every module `module` imports: ours by full dotted name (`from agentgrad.x import y` names `agentgrad.x.y`
    when y is a module), others by their top-level package."""
    path = MODULES[module]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, path.name == "__init__.py")
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
    return frozenset(n if n.startswith("agentgrad") else n.split(".")[0] for n in found if n)


def ours(module: str) -> set[str]:
    return {m for m in imports_of(module) if m == "agentgrad" or m.startswith("agentgrad.")}


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@cache
def reaches(module: str) -> frozenset[str]:
    """Our modules `module` imports, directly or through other modules of ours (its package __init__s too)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for dep in ours(todo.pop()):
            chain = [".".join(dep.split(".")[:i]) for i in range(2, dep.count(".") + 2)]  # a.b.c -> a.b, a.b.c
            for m in chain:
                if m in MODULES and m not in seen:
                    seen.add(m)
                    todo.append(m)
    return frozenset(seen)


def test_the_scan_sees_the_package():
    # a broken scan would pass every rule below: it must find the modules and the imports we know exist
    assert {"agentgrad.types", "agentgrad.batch", "agentgrad.algos.losses", "agentgrad.cli"} <= set(MODULES)
    assert "agentgrad.types" in ours("agentgrad.batch") and "torch" in imports_of("agentgrad.batch")
    assert "agentgrad.pipelines.train" in ours("agentgrad.cli")
    assert "agentgrad.envs.base" in reaches("agentgrad.envs.tasks.arithmetic")


@pytest.mark.parametrize("package", ["agentgrad.tools", "agentgrad.envs"])
def test_tools_and_envs_never_import_torch(package):
    # Envs and tools run in processes (sandboxes, Ray workers, a user's own env) that must not pay for torch.
    offenders = sorted(m for m in MODULES if under(m, package)
                       for via in {m} | reaches(m) if "torch" in imports_of(via))
    assert offenders == [], f"{package} reaches torch through {offenders}"


def test_records_and_math_import_nothing_of_ours_but_each_other():
    allowed = LEAVES | {"agentgrad"}
    for module in MODULES:
        if any(under(module, p) for p in PURE_CORE):
            bad = sorted(d for d in ours(module) if d not in allowed and not any(under(d, p) for p in PURE_CORE))
            assert bad == [], f"{module} imports {bad}"
    for leaf in LEAVES:
        assert ours(leaf) == set(), f"{leaf} must stay a leaf"


def test_only_the_cli_and_pipelines_import_pipelines():
    bad = sorted(m for m in MODULES if not under(m, "agentgrad.pipelines") and m != "agentgrad.cli"
                 and any(under(d, "agentgrad.pipelines") for d in ours(m)))
    assert bad == [], f"{bad} import agentgrad.pipelines (only cli.py wires a run)"


def test_models_do_not_import_backends():
    # The arrow points from backends (which run models) to models, never back.
    bad = sorted(m for m in MODULES if under(m, "agentgrad.models")
                 and any(under(d, "agentgrad.backends") for d in ours(m)))
    assert bad == [], f"{bad} import agentgrad.backends"


def test_the_search_tree_stays_pure():
    # The tree math of search is read and tested alone: no torch, and of ours only the records.
    module = "agentgrad.search.tree"
    assert "torch" not in imports_of(module)
    assert reaches(module) <= {"agentgrad.types"} | LEAVES, sorted(reaches(module))
