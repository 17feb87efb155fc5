"""The layers of the package, read from its source (no imports run): the command line sits on top, the harness
(``hivetrain.testing``, ``hivetrain.chaos``) beside the product, never under it (issue 27 items 1-2)."""

from __future__ import annotations

import ast
from pathlib import Path

import hivetrain

ROOT = Path(hivetrain.__file__).parent
HARNESS = ("testing", "chaos")
"""Packages of the fault harness: they may import the product and each other; the product imports neither."""
HOSTILE_ENTRY = "hivetrain.testing.hostile_peer"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> set[str]:
    """Every hivetrain module ``path`` imports, at the top or inside a function (``from a import b``: a and a.b;
    relative imports resolved)."""
    package = _module_name(path).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return {n for n in names if n == "hivetrain" or n.startswith("hivetrain.")}


def _modules() -> dict[str, set[str]]:
    return {_module_name(p): _imported(p) for p in sorted(ROOT.rglob("*.py"))}


def _under(module: str, package: str) -> bool:
    return module == f"hivetrain.{package}" or module.startswith(f"hivetrain.{package}.")


def test_only_the_command_line_imports_the_command_line():
    """...and the harness's peer, which wraps ``join_swarm.main`` by design (a hostile peer is the real command with
    faults armed): it is the one module outside ``cli/`` allowed to, it imports the CLI only when it runs (in its
    own process), and nothing of the product imports it."""
    arrows = sorted(
        f"{module} -> {name}"
        for module, names in _modules().items()
        if not _under(module, "cli") and module != HOSTILE_ENTRY
        for name in names
        if _under(name, "cli")
    )
    assert arrows == []
    product = {m: names for m, names in _modules().items() if not any(_under(m, h) for h in HARNESS)}
    assert not [m for m, names in product.items() if HOSTILE_ENTRY in names]  # the chaos runner launches it


def test_no_product_module_imports_the_harness():
    arrows = sorted(
        f"{module} -> {name}"
        for module, names in _modules().items()
        if not any(_under(module, h) for h in HARNESS)
        for name in names
        if _under(name, "testing") and not _under(module, "cli.chaos")  # `hivetrain chaos` starts the harness
    )
    assert arrows == []


def test_the_command_line_reaches_the_harness_only_through_hivetrain_chaos():
    arrows = sorted(
        f"{module} -> {name}"
        for module, names in _modules().items()
        if _under(module, "cli") and module != "hivetrain.cli.chaos"
        for name in names
        if any(_under(name, h) for h in HARNESS)
    )
    assert arrows == []


def test_a_node_rank_reaches_the_trainer_as_an_argument_not_a_module_global():
    from hivetrain.diloco import node_ranks

    assert not hasattr(node_ranks, "_CURRENT") and not hasattr(node_ranks, "current_node")
    trainer_imports = _imported(ROOT / "diloco" / "trainer.py")
    assert not any(name.startswith("hivetrain.diloco.node_ranks") for name in trainer_imports)


def test_the_checks_see_real_arrows():
    """The reader finds arrows that exist (so an empty list above means none, not a blind reader)."""
    modules = _modules()
    assert "hivetrain.diloco.builder" in modules["hivetrain.cli.join_swarm"]
    assert "hivetrain.testing.byzantine" in modules["hivetrain.testing.hostile_peer"]
    assert "hivetrain.cli.join_swarm" in modules["hivetrain.testing.hostile_peer"]
    assert "hivetrain.localswarm.forkserver" in modules["hivetrain.localswarm.launcher"]
