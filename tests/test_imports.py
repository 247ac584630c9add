"""No two attnres modules import each other, directly or around a circle.

The graph counts every import a module could run or a type checker follows: module-level ones, those
inside functions, those under ``TYPE_CHECKING``, and module names in strings (``importlib.import_module
("attnres.x.y")``, ``python -m attnres.x``). A circle means one of them can only work by import order.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "attnres"
_MODULE_STRING = re.compile(rf"{PACKAGE}(\.\w+)+(:\w+)?")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its ``__init__``)."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` is, or the closest enclosing one (``attnres.x.y.f`` -> ``attnres.x.y``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, source: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``source`` (the text of ``module``) imports, anywhere in the file."""
    here = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != PACKAGE:
                continue
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_STRING.fullmatch(node.value):
            names = [node.value.partition(":")[0]]
        else:
            continue
        found.update(r for r in (_resolve(n, modules) for n in names) if r is not None)
    found.discard(module)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    return {
        name: imports_of(name, path.read_text(), path.name == "__init__.py", modules) for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as [a, b, ..., a], or None (depth-first search, iterative)."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path = [start], {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                node = path.pop()
                on_path.discard(node)
                done.add(node)
            elif nxt in on_path:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_cycle_finder_finds_a_circle_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_every_kind_of_import(tmp_path):
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    for name in ("__init__", "a", "b", "c", "d", "e", "sub/__init__", "sub/f"):
        (package / f"{name}.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from attnres.b import X\n"
        "def f():\n    import attnres.c\n"
        "LAZY = 'attnres.d:name'\n"
        "from .sub import f\n"
        "from . import e\n"
    )
    assert import_graph(tmp_path)["attnres.a"] == {"attnres.b", "attnres.c", "attnres.d", "attnres.sub.f", "attnres.e"}


def test_no_module_imports_itself_around_a_circle():
    graph = import_graph()
    assert len(graph) > 100  # the whole package was read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_validating_a_config_imports_no_builder():
    """The configs and their checks (attnres.residual.args, attnres.model.backbone_args) reach no module that
    builds a scheme or a model: validation stays apart from the builders, so they never import each other."""
    graph = import_graph()
    builders = {
        "attnres.residual.registry",
        "attnres.residual.base",
        "attnres.residual.attnres",
        "attnres.residual.modules",
        "attnres.model.backbones",
        "attnres.model.llama",
        "attnres.model.kimi_linear",
        "attnres.model.lm",
    }
    assert builders <= set(graph)
    for config in ("attnres.model.config", "attnres.residual.config"):
        assert not reachable(graph, config) & builders, config


def test_the_method_reaches_neither_the_scheme_nor_the_fast_streams():
    """attnres.residual.method (the paper's method in one screen) is what the scheme and the fast streams
    build on: it reaches neither of them, so both import it and no circle can form."""
    graph = import_graph()
    reached = reachable(graph, "attnres.residual.method")
    assert not reached & {"attnres.residual.attnres", "attnres.residual.depth_streams"}, sorted(reached)
