"""The package's layering (docs/architecture.md) as a test: every ``attnres.X`` import, at module
level or inside a function, goes to a lower layer or within its own package, so the packages form
no import circle and a low layer can be read and used without the ones above it."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "attnres"

# lower number = lower layer; a package may import only packages of a strictly lower layer
LAYER = {
    "files": 0,                    # atomic writes, run-directory names, TOML
    "ops": 1, "data": 1,           # pure tensor functions; corpus and tokenizers
    "residual": 2,                 # the schemes, behind one interface
    "model": 3,                    # ModelConfig, AttnResLM
    "parallel": 4,                 # process groups, DDP/FSDP2, pipeline stages
    "checkpoint": 5,               # save / load / load_model
    "inference": 6, "analysis": 6, # caches, prefill, sampling; depth-weight analysis
    "train": 7,                    # optimizer, schedules, metrics, the trainer
    "hf": 8, "experiments": 8,     # transformers integration; specs, runner, reports
    "bench": 9,                    # timing and traffic measurements
    "cli": 10,                     # argument parsing only
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
    bad = [f"line {line}: {own} (layer {rank}) imports attnres.{target} (layer {LAYER[target]})"
           for line, target in attnres_imports(path) if target != own and LAYER[target] >= rank]
    assert not bad, f"{path.relative_to(PACKAGE.parent)}: " + "; ".join(bad)
