"""The scripts outside the package (benchmarks/, examples/, scripts/) call agentgrad's functions with arguments
that bind to their current signatures. Nothing else runs most of these scripts in CI, so a renamed keyword or a
new required argument would only show when someone reruns a study (grpo_vs_ppo.py called `evaluate` without its
`sampler` for weeks). A call with `*args` or `**kwargs` is bound by its explicit part only."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for d in ("benchmarks", "examples", "scripts") for p in (ROOT / d).rglob("*.py"))


def imported_callables(tree: ast.Module) -> dict[str, object]:
    """Names bound by `from agentgrad... import name [as alias]` anywhere in the file -> the objects."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "agentgrad":
            module = importlib.import_module(node.module)
            for alias in node.names:
                obj = getattr(module, alias.name, None)
                if callable(obj):
                    names[alias.asname or alias.name] = obj
    return names


def binding_errors(source: str, name: str) -> list[str]:
    tree = ast.parse(source, filename=name)
    names = imported_callables(tree)
    errors = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names):
            continue
        try:
            signature = inspect.signature(names[node.func.id])
        except (TypeError, ValueError):  # builtins and C functions without one
            continue
        starred = any(isinstance(a, ast.Starred) for a in node.args)
        double_starred = any(k.arg is None for k in node.keywords)
        params = signature.parameters.values()
        if starred or double_starred:
            # only what is certain: every keyword given must exist (or be absorbed by **kwargs)
            takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
            unknown = [k.arg for k in node.keywords if k.arg and k.arg not in signature.parameters and not takes_any]
            if unknown:
                errors.append(f"{name}:{node.lineno}: {node.func.id}() has no {unknown}")
            continue
        try:
            signature.bind(*[None] * len(node.args), **{k.arg: None for k in node.keywords})
        except TypeError as e:
            errors.append(f"{name}:{node.lineno}: {node.func.id}(): {e}")
    return errors


def test_there_are_scripts_to_check():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_calls_into_agentgrad_bind_to_current_signatures(path):
    assert binding_errors(path.read_text(), str(path.relative_to(ROOT))) == []


def test_the_check_catches_a_missing_argument_and_an_unknown_keyword():
    source = ("from agentgrad.pipelines.evaluate import evaluate as run_eval\n"
              "run_eval(policy, codec, suite, limits, num_tasks=100, seed=0)\n"  # the call grpo_vs_ppo.py had
              "run_eval(policy, codec, suite, limits, sampler, num_tasks=100, seed=0)\n"
              "run_eval(*parts, num_task=100)\n")
    errors = binding_errors(source, "probe.py")
    assert len(errors) == 2
    assert errors[0].startswith("probe.py:2:") and "sampler" in errors[0]
    assert errors[1].startswith("probe.py:4:") and "num_task" in errors[1]
