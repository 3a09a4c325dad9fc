"""The rings of STYLE.md, held by parsing every import (lazy ones inside functions included).

Imports under ``if TYPE_CHECKING:`` are left out: they never run. Each import statement of
a treepack module is an edge ``importer -> imported module``; ``from pkg import name``
points at ``pkg.name`` when that is a module of ours, else at ``pkg``.

Point :func:`ring_report` (or ``TREEPACK_RINGS_ROOT``) at another checkout to audit it:
``TREEPACK_RINGS_ROOT=/tmp/old pytest tests/proto/test_rings.py -s``.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(os.environ.get("TREEPACK_RINGS_ROOT", Path(__file__).resolve().parents[2]))
FOLDERS = {
    "proto": "treepack.proto",
    "service": "treepack.service",
    "client": "treepack.client",
    "trainer_plugin": "treepack.trainer",
}


def _under(name: str, pkg: str) -> bool:
    return name == pkg or name.startswith(pkg + ".")


def allowed(importer: str, target: str) -> bool:
    """Whether module ``importer`` may import treepack module ``target`` (the rings)."""
    if _under(importer, "treepack.proto"):
        return _under(target, "treepack.proto")
    if _under(importer, "treepack.service.planner"):
        return _under(target, "treepack.proto") or _under(target, "treepack.service.planner")
    if importer == "treepack.service.cli.check":
        # `treepack check` runs the trainer's parity report: the CLI is the outermost ring, and
        # it imports the trainer lazily (a planner-only install keeps every other command).
        return any(_under(target, p) for p in ("treepack.proto", "treepack.service", "treepack.trainer"))
    if _under(importer, "treepack.service.cli") or importer == "treepack.service.__main__":
        return _under(target, "treepack.proto") or _under(target, "treepack.service")
    if _under(importer, "treepack.service"):
        return _under(target, "treepack.proto") or (
            _under(target, "treepack.service") and not _under(target, "treepack.service.cli")
        )
    if importer == "treepack.client.embedded":
        return any(_under(target, p) for p in ("treepack.proto", "treepack.client", "treepack.service.planner"))
    if _under(importer, "treepack.client"):
        return _under(target, "treepack.proto") or _under(target, "treepack.client")
    if _under(importer, "treepack.trainer.planning"):
        # Before the plan, the floor below data: never data (materialize, PackedBatch) nor a floor above it.
        return any(
            _under(target, p)
            for p in ("treepack.proto", "treepack.client", "treepack.trainer.kernels", "treepack.trainer.planning")
        )
    if _under(importer, "treepack.trainer"):
        return any(_under(target, p) for p in ("treepack.proto", "treepack.client", "treepack.trainer"))
    raise AssertionError(f"no ring for {importer}")


def module_files(root: Path) -> dict[str, Path]:
    """Every module of ours under ``root``: dotted name -> file."""
    out: dict[str, Path] = {}
    for folder, pkg in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((pkg, *parts))] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_edges(root: Path) -> list[tuple[str, str, int]]:
    """(importer, imported module, line) for every import of a treepack module."""
    files = module_files(root)
    edges = []
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in dict.fromkeys(targets):
                if _under(t, "treepack"):
                    edges.append((name, t, node.lineno))
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def ring_report(root: Path = ROOT) -> tuple[list[str], list[list[str]]]:
    """(ring violations as readable lines, import cycles) of the checkout at ``root``."""
    files = module_files(root)
    edges = import_edges(root)
    violations = [f"{files[a].relative_to(root)}:{line}: {a} -> {b}" for a, b, line in edges if not allowed(a, b)]
    graph: dict[str, set[str]] = {m: set() for m in files}
    for a, b, _ in edges:
        if b in files and b != a:
            graph[a].add(b)
    return violations, _cycles(graph)


def _report(violations: list[str], cycles: list[list[str]]) -> str:
    lines = [f"{len(violations)} ring violations, {len(cycles)} cycles", *violations]
    lines += ["cycle: " + " <-> ".join(c) for c in cycles]
    return "\n".join(lines)


def test_rings_outside_the_trainer():
    violations, cycles = ring_report()
    mine = [v for v in violations if not v.startswith("trainer_plugin")]
    print(_report(violations, cycles))
    assert not mine and not cycles, _report(mine, cycles)


def test_trainer_ring():
    violations, _ = ring_report()
    trainer = [v for v in violations if v.startswith("trainer_plugin")]
    print(_report(trainer, []))
    assert not trainer, _report(trainer, [])


def test_the_parser_sees_lazy_imports_and_skips_type_checking(tmp_path):
    (tmp_path / "proto").mkdir()
    for folder in ("service", "client", "trainer_plugin"):
        (tmp_path / folder).mkdir()
    (tmp_path / "proto" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from treepack.service import x\n"
        "def f():\n    from treepack.client import y\n"
        "from . import b\n"
    )
    (tmp_path / "proto" / "b.py").write_text("import treepack.proto.a\n")
    violations, cycles = ring_report(tmp_path)
    assert violations == ["proto/a.py:5: treepack.proto.a -> treepack.client"]
    assert cycles == [["treepack.proto.a", "treepack.proto.b"]]
