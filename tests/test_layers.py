"""The package's layering (docs/architecture.md) as a test: every ``attnres.X`` import, at module
level or inside a function, goes to a lower layer or within its own package, so the packages form
no import circle and a low layer can be read and used without the ones above it; and no import circle
between modules either, inside one package included."""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "attnres"

# lower number = lower layer; a package may import only packages of a strictly lower layer
LAYER = {
    "files": 0,  # atomic writes, run-directory names, TOML
    "ops": 1,
    "data": 1,  # pure tensor functions; corpus and tokenizers
    "residual": 2,  # the schemes, behind one interface
    "model": 3,  # ModelConfig, AttnResLM
    "parallel": 4,  # process groups, DDP/FSDP2, pipeline stages
    "checkpoint": 5,  # save / load / load_model
    "inference": 6,
    "analysis": 6,  # caches, prefill, sampling; depth-weight analysis
    "train": 7,  # optimizer, schedules, metrics, the trainer
    "hf": 8,
    "integrations": 8,  # torchtitan's model spec of AttnResLM
    "experiments": 8,  # transformers integration; specs, runner, reports
    "bench": 9,  # timing and traffic measurements
    "serving": 9,  # GGUF (llama.cpp) and mlx-lm exports of Kimi Linear models
    "cli": 10,  # argument parsing only
}
ENTRY_POINTS = {"__init__": 3.5, "__main__": 11}  # the package root re-exports model-level names


def package_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def attnres_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "attnres" and len(parts) > 1 and parts[1] in LAYER:
                yield node.lineno, parts[1]
                break


def test_every_package_has_a_layer():
    found = {package_of(p) for p in PACKAGE.rglob("*.py")}
    assert found - set(LAYER) - set(ENTRY_POINTS) == set(), "add new packages to LAYER and docs/architecture.md"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_the_layers(path):
    own = package_of(path)
    rank = LAYER.get(own, ENTRY_POINTS.get(own))
    bad = [
        f"line {line}: {own} (layer {rank}) imports attnres.{target} (layer {LAYER[target]})"
        for line, target in attnres_imports(path)
        if target != own and LAYER[target] >= rank
    ]
    assert not bad, f"{path.relative_to(PACKAGE.parent)}: " + "; ".join(bad)


# ----------------------------------------------------------------------------- no circle between modules
# Within a package too, modules import one way: the module graph of attnres/ (every import, at module level or
# inside a function, absolute or relative; ``from attnres.pkg import name`` imports the submodule when ``name`` is
# one, else the package's __init__) has no strongly connected component. Imports under ``if TYPE_CHECKING:`` run
# for type checkers only and are left out.


def module_names() -> dict:
    """Dotted name -> path of every module; a package's __init__ goes by the package's name."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node):
    for child in ast.iter_child_nodes(node):
        for stmt in child.orelse if isinstance(child, ast.If) and _type_checking_only(child) else [child]:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                yield stmt
            else:
                yield from _import_nodes(stmt)


def module_imports(name: str, path: Path, modules: dict):
    """(line, imported module) for every import of ``name`` (at ``path``) that names a module of attnres."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield node.lineno, alias.name
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(anchor + ([node.module] if node.module else []))
        for alias in node.names:
            if f"{base}.{alias.name}" in modules:
                yield node.lineno, f"{base}.{alias.name}"
            elif base in modules:
                yield node.lineno, base


def import_graph() -> dict:
    modules = module_names()
    graph = {name: {} for name in modules}
    for name, path in modules.items():
        for line, target in module_imports(name, path, modules):
            if target != name:
                graph[name].setdefault(target, line)
    return graph


def strongly_connected(graph: dict) -> list:
    """Tarjan's algorithm: the components of more than one module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_sees_submodules_packages_and_relative_imports(tmp_path, monkeypatch):
    root = tmp_path / "attnres"
    (root / "pkg").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "pkg" / "__init__.py").write_text("from attnres.pkg.a import f\n")
    (root / "pkg" / "a.py").write_text("def f():\n    from . import b\n")
    (root / "pkg" / "b.py").write_text("from attnres.pkg import c, name_in_init\n")
    (root / "pkg" / "c.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from attnres.pkg.a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", root)
    graph = import_graph()
    assert set(graph["attnres.pkg"]) == {"attnres.pkg.a"}
    assert set(graph["attnres.pkg.a"]) == {"attnres.pkg.b"}
    assert set(graph["attnres.pkg.b"]) == {"attnres.pkg.c", "attnres.pkg"}
    assert set(graph["attnres.pkg.c"]) == set()  # type checkers only
    assert strongly_connected(graph) == [["attnres.pkg", "attnres.pkg.a", "attnres.pkg.b"]]


def test_no_import_circle_between_modules():
    graph = import_graph()
    circles = []
    for component in strongly_connected(graph):
        edges = [f"{a} -> {b} (line {graph[a][b]})" for a in component for b in sorted(graph[a]) if b in component]
        circles.append("; ".join(edges))
    assert not circles, "import circles (move what both need to the lowest module that needs it): " + " || ".join(
        circles
    )
