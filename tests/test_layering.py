"""The library never imports the application layer: dependencies point one way."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "idml"


def _imports(path: Path) -> set[str]:
    """Every module an ``import`` or ``from … import`` in ``path`` names (absolute imports)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_library_module_imports_the_application_layer() -> None:
    library = [p for p in SRC.rglob("*.py") if "app" not in p.relative_to(SRC).parts]
    assert len(library) > 40  # the scan reads the tree, not an empty glob
    offending = {
        str(p.relative_to(SRC)): sorted(n for n in _imports(p) if n.startswith("idml.app"))
        for p in library
    }
    offending = {k: v for k, v in offending.items() if v and k != "__main__.py"}
    assert not offending, f"library modules importing idml.app: {offending}"


def test_the_application_layer_is_a_folder_of_its_own() -> None:
    top = {p.name for p in SRC.iterdir() if not p.name.startswith(("_", "."))}
    for app_module in ("config", "build", "training", "cli", "reports", "ablation", "inference"):
        assert not (SRC / f"{app_module}.py").exists() and app_module not in top
        assert (SRC / "app" / app_module).exists() or (SRC / "app" / f"{app_module}.py").exists()
