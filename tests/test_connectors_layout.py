"""The connectors subpackage keeps its shape: one concept per module, none over ~500 lines, no
import cycle between its modules (counting imports inside functions too), and pyspark named
only by the Spark adapters."""
from __future__ import annotations

import ast
from pathlib import Path

import abs.connectors

PACKAGE = Path(abs.connectors.__file__).parent
MODULES = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(sibling modules imported, top-level external packages imported) anywhere in the file."""
    siblings: set[str] = set()
    external: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
                siblings.update(n.split(".")[0] for n in names if n.split(".")[0] in MODULES)
            elif node.level == 0 and node.module:
                external.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            external.update(a.name.split(".")[0] for a in node.names)
    return siblings, external


def test_no_import_cycle_between_the_connector_modules():
    graph = {name: _imports(path)[0] for name, path in MODULES.items()}
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", f"import cycle: {' -> '.join(trail + [name])}"
        state[name] = "open"
        for dep in sorted(graph[name]):
            visit(dep, trail + [name])
        state[name] = "done"

    for name in sorted(graph):
        visit(name, [])
    assert graph["sources"] == set() and graph["sinks"] == set()
    assert "spark_stream" not in graph["batchlog"] and "file_sink" not in graph["file_source"]


def test_only_the_spark_adapters_import_pyspark():
    importing = {name for name, path in MODULES.items() if "pyspark" in _imports(path)[1]}
    assert importing and all(name.startswith("spark_") for name in importing), importing


def test_every_connector_module_stays_small():
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert max(sizes.values()) <= 500, sizes
