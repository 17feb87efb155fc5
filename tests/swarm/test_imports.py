"""Layering: ``hivetrain/swarm`` is a library: it imports nothing from ``hivetrain.cli``, and its modules do not
import each other in a circle (any import, also inside functions, read from the source with ``ast``)."""

from __future__ import annotations

import ast
from pathlib import Path

import hivetrain.swarm

SWARM_DIR = Path(hivetrain.swarm.__file__).parent


def imported_modules(path: Path, module_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_swarm_imports_nothing_from_cli():
    offenders = {
        path.name: sorted(n for n in imported_modules(path, module_level_only=False) if n.startswith("hivetrain.cli"))
        for path in SWARM_DIR.glob("*.py")
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_swarm_modules_import_each_other_without_a_circle():
    modules = {f"hivetrain.swarm.{p.stem}": p for p in SWARM_DIR.glob("*.py") if p.stem != "__init__"}
    graph = {name: imported_modules(path, module_level_only=False) & set(modules) for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, stack: tuple[str, ...]) -> None:
        assert name not in stack, f"import circle: {' -> '.join([*stack, name])}"
        if name in done:
            return
        for dep in graph[name]:
            visit(dep, (*stack, name))
        done.add(name)

    for name in graph:
        visit(name, ())
