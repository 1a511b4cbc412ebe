"""No import cycle anywhere in pefa_gpu: every import statement of every module, those inside
functions included, read from the source (nothing is imported to find them)."""

from __future__ import annotations

import ast
from pathlib import Path

import pefa_gpu

ROOT = Path(pefa_gpu.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = ("pefa_gpu",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The pefa_gpu modules that ``name`` imports, at module level or inside functions. A
    submodule brings along its parent packages below pefa_gpu that do not hold ``name`` (Python
    imports them first); ``from X import y`` names the submodule X.y when there is one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target.startswith("pefa_gpu") and target not in known:
                target = target.rpartition(".")[0]  # pefa_gpu.x.attr -> pefa_gpu.x
            parts = target.split(".")
            out.update(p for p in (".".join(parts[:i]) for i in range(2, len(parts) + 1))
                       if p == target or not name.startswith(p + "."))
            if target == "pefa_gpu":
                out.add(target)
    out.discard(name)
    return {t for t in out if t in known}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert len(graph) > 20 and "pefa_gpu.models" in graph["pefa_gpu.sweep"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles_and_function_level_imports(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    known = modules()
    src = tmp_path / "mod.py"
    src.write_text("def f():\n    from .models import ERM\n    from . import __version__\n")
    found = imports("pefa_gpu.mod", src, {**known, "pefa_gpu.mod": src})
    assert found == {"pefa_gpu.models", "pefa_gpu"}
    src.write_text("from .index.exact import ExactIndex\n")
    assert imports("pefa_gpu.mod", src, known) == {"pefa_gpu.index", "pefa_gpu.index.exact"}
    src.write_text("from .exact import ExactIndex\n")  # a package's own modules: no edge to it
    assert imports("pefa_gpu.index.hnsw", src, known) == {"pefa_gpu.index.exact"}
