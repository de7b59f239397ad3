"""No import cycle among the API's modules: the graph of every `import` in webapp/ (at the top
of a module or inside a function; `if TYPE_CHECKING:` blocks and a package's implicit import
of its parents left out) has no cycle. webapp/batches.py and webapp/routes/batches.py were one,
the batches module registering its own blueprint."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imports(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if _type_checking(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def import_graph(root: Path = ROOT, package: str = "webapp") -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports."""
    files = {module_name(root, p): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps = graph.setdefault(name, set())
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package (a package's own, for __init__)
                    parts = name.split(".")
                    anchor = parts[: len(parts) - node.level + (path.name == "__init__.py")]
                    base = ".".join(anchor + ([base] if base else []))
                # `from a import b` imports the module a.b if there is one, else a name of a.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            deps.update(t for t in targets if t in files and t != name)
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return exc.args[1]
    return None


def test_webapp_has_no_import_cycle():
    graph = import_graph()
    assert "webapp.batches" in graph["webapp.routes.batches"]  # the graph does see the imports
    found = cycle(graph)
    assert found is None, f"import cycle: {' -> '.join(found)}"


def test_a_cycle_is_found(tmp_path):
    """The check itself: two modules importing each other (one inside a function, through a
    relative import in a package) are a cycle; a TYPE_CHECKING import is not."""
    pkg = tmp_path / "webapp"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from webapp import b\n")
    (pkg / "b.py").write_text("from webapp.sub.a import f\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from webapp import b\n")
    graph = import_graph(tmp_path)
    assert graph == {
        "webapp": set(),
        "webapp.sub": {"webapp.sub.a"},
        "webapp.sub.a": {"webapp.b"},
        "webapp.b": {"webapp.sub.a"},
        "webapp.c": set(),
    }
    assert set(cycle(graph)) == {"webapp.sub.a", "webapp.b"}
