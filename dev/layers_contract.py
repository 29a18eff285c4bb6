"""import-linter's layers contract, extended to the project's top-level modules.

grimp builds import graphs of packages only, so `train.py`, `partial_fc.py`, `losses.py` and
`dataset.py` would be seen only as what the packages import. This contract reads their own import
statements (function-level ones included) and adds them to the graph before checking the layers as
import-linter's own `layers` contract does. Configured in pyproject.toml; run by `lint-imports`.
"""
from __future__ import annotations

import ast
from pathlib import Path

from importlinter.contracts.layers import LayersContract
from importlinter.domain import fields

ROOT = Path(__file__).resolve().parent.parent


class TopLevelLayersContract(LayersContract):
    type_name = "top_level_layers"

    top_level_modules = fields.ListField(subfield=fields.StringField())

    def check(self, graph, verbose: bool):
        for name in self.top_level_modules:
            if name not in graph.modules:  # a top-level module nothing in the packages imports (train)
                graph.add_module(name, is_squashed=True)
        for name in self.top_level_modules:
            source = ROOT / f"{name}.py"
            lines = source.read_text().splitlines()
            for node in ast.walk(ast.parse(source.read_text(), str(source))):
                for imported in _imported_modules(node, graph.modules):
                    graph.add_import(importer=name, imported=imported, line_number=node.lineno,
                                     line_contents=lines[node.lineno - 1].strip())
        return super().check(graph, verbose)


def _imported_modules(node: ast.AST, known: set[str]) -> list[str]:
    """The graph's modules an import statement names (the most specific one each name resolves to)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [f"{node.module}.{alias.name}" for alias in node.names]
    else:
        return []
    found = []
    for name in names:
        parts = name.split(".")
        candidates = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        found += [next(c for c in candidates if c in known)] if any(c in known for c in candidates) else []
    return found
